"""What the SFT, RM and DPO loops log at every optimizer step beside their loss terms."""

from __future__ import annotations

from engine.run.distributed import accelerator_memory_metrics


def optimizer_step_metrics(
    kind: str, engine, epochs: float, seconds: float, tokens: int, skipped: int
) -> dict[str, float]:
    """``kind``/lr, grad_norm and epoch (``epochs`` done), the step's time and token throughput,
    the steps the non-finite guard discarded so far (``skipped``) and the accelerator's memory."""
    return {
        f"{kind}/lr": engine.get_lr()[0],
        f"{kind}/grad_norm": float(engine.get_global_grad_norm() or 0.0),
        f"{kind}/epoch": epochs,
        "timing/step_s": seconds,
        "timing/tokens_per_s": tokens / seconds,
        "guard/nonfinite_skipped": skipped,
    } | accelerator_memory_metrics()
