"""GPU-path checks for a lent device (run by tests/gpu/check.sh; needs CUDA, so not part of pytest).

    python tests/gpu/device_checks.py TINY_MODEL_DIR

Each check prints PASS or FAIL with its numbers; the exit status is the number of failures.
"""

from __future__ import annotations

import os
import sys

import torch

from engine.data.packing import last_token, pack_sequences, packed_forward
from engine.data.response_tokens import response_logprobs
from engine.models.loading import load_causal_lm, load_value_model, resolve_attention
from engine.ppo.forwards import ValueReadout, response_values
from engine.rollout.sampler import HFSampler, SamplingSettings
from engine.run.checkpoint import rng_state, set_rng_state
from engine.run.distributed import all_reduce

failures: list[str] = []  # names of the failed checks


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        failures.append(name)
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def main(model_dir: str) -> int:
    cuda = torch.device("cuda", 0)
    torch.manual_seed(0)
    seqs = [torch.randint(4, 500, (n,)).tolist() for n in (40, 7, 65, 23)]
    prompt_lens = [10, 3, 30, 5]
    packed = pack_sequences(seqs)

    cpu_lm, gpu_lm = load_causal_lm(model_dir), load_causal_lm(model_dir).to(cuda)
    want, _ = response_logprobs(cpu_lm, packed, prompt_lens)
    got, entropy = response_logprobs(gpu_lm, packed, prompt_lens, with_entropy=True)
    gap = max((g - w).abs().max().item() for g, w in zip(got, want))
    check("packed log-probs cuda == cpu (fp32)", gap < 1e-4 and got[0].device.type == "cpu", f"max gap {gap:.2e}")
    check("entropy comes back detached, on the CPU", entropy[0].device.type == "cpu" and not entropy[0].requires_grad)
    torch.cat(got).sum().backward()
    grad = gpu_lm.lm_head.weight.grad
    check("loss on CPU log-probs backpropagates into GPU weights", grad is not None and grad.abs().sum().item() > 0)

    torch.manual_seed(1)
    cpu_vm = load_value_model(model_dir, ["a", "b"])
    gpu_vm = load_value_model(model_dir, ["a", "b"])
    gpu_vm.load_state_dict(cpu_vm.state_dict())
    gpu_vm.to(cuda)
    with torch.no_grad():
        r_cpu, r_gpu = (
            last_token(packed_forward(cpu_vm, packed), packed),
            last_token(packed_forward(gpu_vm, packed), packed),
        )
        v_gpu = response_values(packed_forward(gpu_vm, packed), packed, prompt_lens, ValueReadout(torch.ones(2)))
    check(
        "rewards at the last token cuda == cpu",
        torch.allclose(r_cpu, r_gpu, atol=1e-4) and r_gpu.device.type == "cpu",
        f"max gap {(r_cpu - r_gpu).abs().max().item():.2e}",
    )
    check("values come back on the CPU", all(v.device.type == "cpu" for v in v_gpu))

    bf16_lm = load_causal_lm(model_dir, dtype=torch.bfloat16).to(cuda)
    lp16, _ = response_logprobs(bf16_lm, packed, prompt_lens)
    gap16 = max((g - w).abs().max().item() for g, w in zip(lp16, want))
    check(
        "bf16 log-probs near fp32",
        gap16 < 0.5,
        f"max gap {gap16:.3f} (attention: {bf16_lm.config._attn_implementation}, "
        f"auto -> {resolve_attention('auto', torch.bfloat16)})",
    )

    sampler = HFSampler(gpu_lm, pad_token_id=0, eos_token_id=3)
    out = sampler.generate([seqs[0][:10], seqs[1][:3]], SamplingSettings(n=2, max_new_tokens=8), request_seed=0)
    check(
        "HF generate on cuda",
        len(out) == 2 and all(len(s.response_ids) <= 8 for g in out for s in g),
        f"{[len(s.response_ids) for g in out for s in g]} tokens",
    )

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.distributed.init_process_group("nccl", device_id=cuda)
    t = all_reduce(torch.tensor([2.0, 3.0]))
    check("NCCL all_reduce of a CPU tensor", t.tolist() == [2.0, 3.0] and t.device.type == "cpu")
    torch.distributed.destroy_process_group()

    state = rng_state()
    a = torch.rand(3, device=cuda)
    set_rng_state(state)
    check("CUDA RNG in the checkpointed RNG state", bool(state["cuda"]) and torch.equal(a, torch.rand(3, device=cuda)))
    print(f"{len(failures)} failure(s)")
    return len(failures)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
