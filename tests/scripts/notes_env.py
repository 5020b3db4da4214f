"""A test environment for multi-turn runs (``rollout.environment.name`` ``notes_env:Notes``, with
tests/scripts on PYTHONPATH): up to three turns, each finished turn scored by its length (a flat 0.25
for the prompts of even length: groups without signal, for dynamic sampling) and answered with a note."""

from engine.environments.environment import Environment


class Notes(Environment):
    def reset(self, prompt):
        self.turns, self.flat = 0, len(prompt[-1]["content"]) % 2 == 0

    def step(self, text):
        self.turns += 1
        return f"note {self.turns}", 0.25 if self.flat else len(text) % 5 / 4, self.turns == 3

    def metrics(self):
        return {"steps": self.turns}
