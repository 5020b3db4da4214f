"""The ``rewards`` section of train/train_ppo.py's config: the components of the score besides the
reward model (built-in verifiers, reward functions, a reward server), and how they are run."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from engine.config import Config, ConfigError, option, required

WEIGHT = "weight in the score (0: computed and logged, not optimised)"
FALLBACK = "value of a response whose call raised or timed out"


class MathReward(Config):
    weight: float = option(1.0, WEIGHT)
    field: str = option("answer", "prompt-data column holding the reference answer")
    pattern: str = option(
        "",
        "regular expression whose first group is the final answer ('': the last \\boxed{...}, else what follows "
        "the last '####')",
    )
    fallback: float = option(0.0, FALLBACK)


class CodeReward(Config):
    weight: float = option(1.0, WEIGHT)
    field: str = option(
        "tests", "prompt-data column holding the tests ('assert <expr> == <value>' strings, or {input, output})"
    )
    cpu_s: int = option(5, "CPU seconds of one response's code", ge=1)
    wall_s: float = option(10.0, "wall-clock seconds of one response's code; then its processes are killed", gt=0)
    memory_mb: int = option(1024, "address-space limit of one response's code", ge=16)
    fallback: float = option(0.0, FALLBACK)
    allow_unisolated: bool = option(
        False,
        "run the code even where the sandbox cannot create namespaces: it then runs as the uid that scores it, with "
        "the host's network and every file that uid may read or write (false: such a run is refused)",
    )


class FormatReward(Config):
    pattern: str = required("regular expression the response must contain (1.0 if found, else 0.0)")
    weight: float = option(1.0, WEIGHT)


class LengthPenalty(Config):
    target_tokens: int = required(
        "responses up to this many tokens get 0; longer ones fall linearly to -1 at the limit"
    )
    weight: float = option(1.0, WEIGHT)


class FunctionReward(Config):
    function: str = required(
        "'module:function' called as f(prompt_messages, response_text, **fields) -> float in a reward worker "
        "(the module is found from the working directory)"
    )
    weight: float = option(1.0, WEIGHT)
    fields: list[str] = option([], "prompt-data columns passed to the function as keyword arguments")
    fallback: float = option(0.0, FALLBACK)
    timeout_s: float | None = option(None, "per-response timeout (None: rewards.timeout_s)", gt=0)

    def check(self) -> None:
        module, _, name = self.function.partition(":")
        if not module or not name:
            raise ConfigError(f"function {self.function!r} must look like 'module:function'")


class RemoteReward(Config):
    url: str = required("base URL of a reward server (python -m engine.rewards.server), e.g. http://127.0.0.1:8000")
    components: dict[str, float] = required("the server's components to use -> weight")
    fields: list[str] = option([], "prompt-data columns sent with each response")
    token_env: str | None = option(
        None, "environment variable holding the server's token, sent with every request (None: no token)"
    )
    timeout_s: float = option(30.0, "timeout of one request", gt=0)
    retries: int = option(3, "retries of a failed request (backoff doubling from backoff_s) before the run stops", ge=0)
    backoff_s: float = option(1.0, "wait before the first retry", ge=0)
    fallback: float = option(0.0, "value of a response the server could not score")

    def check(self) -> None:
        if self.token_env == "":
            raise ConfigError("token_env '' names no environment variable: give one, or null for no token")


NonNegativeFloat = Annotated[float, Field(ge=0)]


class RewardsSection(Config):
    math: MathReward | None = option(None, "the response's final answer checked against a column with math-verify")
    code: CodeReward | None = option(None, "the response's Python code run against a column's tests in the sandbox")
    format: FormatReward | None = option(None, "a regular expression the response must contain")
    length: LengthPenalty | None = option(None, "a penalty on responses longer than a target")
    functions: dict[str, FunctionReward] = option({}, "reward functions by name")
    remote: RemoteReward | None = option(None, "components scored by a reward server")
    workers: int = option(2, "reward worker processes per rank (math, code, format and functions run there)", ge=1)
    timeout_s: float = option(10.0, "per-response timeout of a reward function (code: its wall_s + 5)", gt=0)
    import_timeout_s: float = option(
        120.0,
        "seconds a reward worker may take to import the components' modules when it starts (math-verify's sympy, "
        "a function's module); a module that fails or takes longer refuses the run before any model loads",
        gt=0,
    )
    max_failure_share: float = option(
        0.5,
        "stop the run (checkpoint, exit 2) when a component fails on more than this share of a batch's responses",
        ge=0,
        le=1,
    )
    clip: float = option(10.0, "clip the total score to [-clip, clip]", gt=0)
    no_eos_penalty: float = option(0.0, "added to the score of responses cut at max_new_tokens (e.g. -1.0)")

    def weights(self) -> dict[str, float]:
        """The configured components (reward/<name> in the metrics), reward model aside -> their weights."""
        builtins = {name: getattr(self, name) for name in ("math", "code", "format", "length")}
        weights = {name: part.weight for name, part in builtins.items() if part is not None}
        weights |= {name: fn.weight for name, fn in self.functions.items()}
        return weights | ({f"remote_{c}": w for c, w in self.remote.components.items()} if self.remote else {})

    def fields(self, prefix: str = "rewards") -> dict[str, str]:
        """The prompt-data columns the components read -> the (first) config key naming each
        (``prefix``: where this section sits in the config)."""
        wanted = [(f"{prefix}.math.field", self.math.field)] if self.math else []
        wanted += [(f"{prefix}.code.field", self.code.field)] if self.code else []
        wanted += [(f"{prefix}.functions.{name}.fields", f) for name, fn in self.functions.items() for f in fn.fields]
        wanted += [(f"{prefix}.remote.fields", f) for f in self.remote.fields] if self.remote else []
        readers: dict[str, str] = {}
        for key, column in wanted:
            readers.setdefault(column, key)
        return readers

    def check(self) -> None:
        clash = sorted(set(self.functions) & {"math", "code", "format", "length"})
        if clash:
            raise ConfigError(f"functions {clash} have a built-in component's name: rename them")


class RewardModelSection(Config):
    path: str = required("reward model directory (output of train_rm.py: model/)")
    weight: float = option(1.0, "weight of the reward model's (normalised) total in the score")
    normalize: bool = option(True, "standardise the score with the model's reward_stats.json mean/std")
    length_debias: bool = option(
        False,
        "take out of the reward model's score, per batch, its linear trend on response length (its regression "
        "slope on the sampled token count): for reward models that prefer longer answers more than the task does",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        moved = {"rules": "rewards.functions (name -> {function, weight})", "clip": "rewards.clip"}
        moved["no_eos_penalty"] = "rewards.no_eos_penalty"
        for key in moved.keys() & (data.keys() if isinstance(data, dict) else set()):
            raise ConfigError(f"reward_model.{key} moved to {moved[key]}")
        return data
