"""pass@k: the chance that at least one of k samples of a prompt is correct, estimated without bias
from n >= k samples of which c are correct (Chen et al. 2021, "Evaluating Large Language Models
Trained on Code", eq. 1 and its numerically stable form in their Figure 3):

    pass@k = E_prompts[ 1 - C(n - c, k) / C(n, k) ] = E_prompts[ 1 - prod_{i = n-c+1}^{n} (1 - k / i) ]
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """One prompt's unbiased pass@k from ``n`` samples of which ``c`` are correct (1 <= k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over prompts; ``correct[p]``: whether each of prompt p's samples is correct."""
    return sum(pass_at_k(len(row), sum(row), k) for row in correct) / len(correct)


def reported_ks(n: int) -> list[int]:
    """The k reported for n samples a prompt: 1, the powers of two below n, and n."""
    return sorted({1, n, *(2**i for i in range(n.bit_length()) if 2**i < n)})
