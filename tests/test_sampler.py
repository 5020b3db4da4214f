"""engine/rollout/sampler.py: HFSampler against a naive greedy loop (VLLMSampler against the
actor after every sync: tests/test_weight_sync.py and the PPO runs' sampler_logprob_gap)."""

from __future__ import annotations

import torch

from engine.models.loading import load_causal_lm
from engine.rollout.sampler import HFSampler, SamplingSettings


def naive_greedy(model, prompt: list[int], max_new_tokens: int, eos: int) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logp = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float().log_softmax(-1)
            token = int(logp.argmax())
            ids.append(token)
            logprobs.append(float(logp[token]))
            if token == eos:
                break
    return ids[len(prompt) :], logprobs


def test_hf_sampler_greedy_equals_a_naive_loop_and_sampling_follows_the_request_seed(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir)).eval()
    eos = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else model.config.eos_token_id[0]
    sampler = HFSampler(model, pad_token_id=0, eos_token_id=eos)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 5)
    ]  # left-padded together
    greedy = sampler.generate(prompts, SamplingSettings(n=1, temperature=0.0, max_new_tokens=12), request_seed=0)
    for prompt, [sample] in zip(prompts, greedy):
        tokens, logprobs = naive_greedy(model, prompt, 12, eos)
        assert sample.prompt_ids == prompt and sample.response_ids == tokens
        assert sample.finished == (tokens[-1] == eos)
        torch.testing.assert_close(torch.tensor(sample.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)

    settings = SamplingSettings(n=4, temperature=1.0, max_new_tokens=12)
    trainer_draw = torch.get_rng_state()
    first = sampler.generate(prompts, settings, request_seed=7)
    assert torch.equal(torch.get_rng_state(), trainer_draw)  # the trainer's RNG stream is untouched
    assert sampler.generate(prompts, settings, request_seed=7) == first
    assert sampler.generate(prompts, settings, request_seed=8) != first
    assert all(len(group) == 4 for group in first) and len({tuple(s.response_ids) for s in first[1]}) > 1


def test_stale_tensor_parallel_shared_memory_is_removed_and_live_is_kept(process_group, tmp_path):
    """engine/rollout/cpu_shm.py: a segment a live process maps stays, one a killed engine left goes."""
    import mmap

    from engine.rollout.cpu_shm import remove_stale_segments

    live, stale, other = (tmp_path / name for name in ("-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1", "data"))
    for path in (live, stale, other):
        path.write_bytes(b"\0" * 4096)
    with live.open("r+b") as f, mmap.mmap(f.fileno(), 4096):  # as the running engine holds its segment
        assert remove_stale_segments(tmp_path) == [stale]
        assert live.exists() and not stale.exists() and other.exists()
