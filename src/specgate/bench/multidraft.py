"""Would multi-draft (tree) verification pay? The root's acceptance with k drafts against what a verified token
costs (bench/bench_multidraft.py).

A tree verifies k candidate first tokens in one target pass instead of one. Its best case per extra branch is a
single token: accepted, it turns a step that would emit 1 token (the residual's) into 2. So an extra branch adds
at most the rise in the root's acceptance probability (accepted tokens per step) and costs at least one more
verified position in the target pass. With the chain at AL tokens per S target steps, the ratio rises only if
gain / cost > AL / S, and a chain that pays has AL / S >= 1: a gain per branch above the cost of one more
verified token is necessary, whatever the tree's shape. That cost is taken from the target's forward alone, V(t)
for a pass of t tokens in 1-token passes, as its mean slope (V(t_max) - 1) / (t_max - 1); the engine's own work
per verified position (its logits' softmax and sampling at temperature 1) comes on top, so clearing it is
necessary, not sufficient.

Root acceptance, teacher-forced on held-out text: at every position, p is the target's next-token distribution,
q the head's first draft's (it reads the target's state, as a chain's first draft does). Greedy: the chance the
target's argmax is among the head's top k. Temperature 1: recursive rejection sampling without replacement (draw
x_i from q_i, accept with min(1, r_i(x_i) / q_i(x_i)); on rejection r_{i+1} = norm((r_i - q_i)+) and q_{i+1} is
q_i without x_i, renormalised; exact for any q_i, so its acceptance is what an exact multi-draft verifier gets),
estimated by Monte Carlo. Both run over the head's d2t columns plus one bucket holding the target's mass on every
other token (q is 0 there, so the bucket is never drafted and moves as those tokens would together).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor



def on_draft_columns(p: Tensor, d2t: Tensor) -> Tensor:
    """p `# [N, V_t]` -> `# [N, V_d + 1]`: its entries on d2t's ids, then the rest of its mass in one bucket."""
    inside = p[:, d2t]
    return torch.cat([inside, (1.0 - inside.sum(-1, keepdim=True)).clamp(min=0.0)], -1)


@torch.no_grad()
def root_distributions(target: Any, head: Any, texts: list[str], temperature: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """Over every position of each text that has a first draft: p and q on the head's columns `# [N, V_d + 1]`
    (q's bucket 0) at `temperature` (> 0; q also at the head's sample_temperature, as drafts are drawn), and the
    target's argmax's draft column, -1 outside d2t `# [N]`."""
    model = target.model
    column = torch.full((model.vocab_size,), -1, dtype=torch.int64)
    column[head.d2t] = torch.arange(head.d2t.numel())
    ps, qs, tops = [], [], []
    sharpen = float(head.config.sample_temperature)  # as the drafter samples (EagleConfig)
    for text in texts:
        ids = target.tokenizer(text, return_tensors="pt")["input_ids"]  # [1, T]
        length = ids.shape[1]
        if length < 3:
            continue
        # one pass gives the logits and the final-norm states the engine hands the head
        logits, hidden = model.forward(ids, torch.arange(length)[None], model.new_cache(1, length), torch.zeros(1, dtype=torch.int64), return_hidden=True)
        features = hidden.float()[:, :, None]  # [1, T, 1, H]
        # head index j reads (h_j, x_{j+1}) and drafts x_{j+2}: the target's distribution after x_{j+1}
        draft_logits = head.unrolled(ids[:, 1 : length - 1], features[:, : length - 2], 1)[0][0][0].float()  # [T-2, V_d]
        target_logits = logits[0, 1 : length - 1].float()  # [T-2, V_t]
        ps.append(on_draft_columns(torch.softmax(target_logits / temperature, -1), head.d2t))
        qs.append(torch.nn.functional.pad(torch.softmax(draft_logits / (temperature * sharpen), -1), (0, 1)))
        tops.append(column[target_logits.argmax(-1)])
    if not ps:
        raise ValueError("no text has 3 or more tokens: give held-out texts long enough to draft after")
    return torch.cat(ps), torch.cat(qs), torch.cat(tops)


def greedy_top_k(q: Tensor, top: Tensor, k: int) -> list[float]:
    """P(the target's argmax is among q's top j), j = 1..k: greedy's root acceptance with j distinct drafts."""
    ranked = q[:, :-1].topk(k, -1).indices  # [N, k] draft columns, the bucket excluded
    hit = (ranked == top[:, None]).cumsum(-1).clamp(max=1).float()  # [N, k]
    return hit.mean(0).tolist()


def recursive_rejection(p: Tensor, q: Tensor, k: int, trials: int, generator: torch.Generator) -> list[float]:
    """Monte Carlo P(one of the first j drafts is accepted), j = 1..k, under recursive rejection sampling without
    replacement (module docstring), averaged over the N rows of p and q `# [N, V]` and `trials` runs."""
    n = p.shape[0]
    accepted = torch.zeros(k, dtype=torch.float64)
    for _ in range(trials):
        residual, proposal = p.clone(), q.clone()
        done = torch.zeros(n, dtype=torch.bool)
        for j in range(k):
            live = proposal.sum(-1) > 0  # rows whose q has tokens left to draft
            drawn = torch.multinomial(torch.where(live[:, None], proposal, 1.0), 1, generator=generator)  # [N, 1]
            r_x, q_x = residual.gather(1, drawn)[:, 0], proposal.gather(1, drawn)[:, 0]
            uniform = torch.rand(n, generator=generator, dtype=torch.float64)
            done |= live & (uniform * q_x.double() < r_x.double())
            accepted[j] += done.double().mean()
            residual = (residual - proposal).clamp(min=0.0)
            residual = residual / residual.sum(-1, keepdim=True).clamp(min=1e-30)
            proposal = proposal.scatter(1, drawn, 0.0)
            proposal = proposal / proposal.sum(-1, keepdim=True).clamp(min=1e-30)
    return (accepted / trials).tolist()


def multidraft_table(acceptance: dict[str, dict[str, list[float]]], verify_cost: list[float]) -> list[str]:
    """The markdown table: per category and mode, the root's acceptance with 1..k drafts, the best extra draft's
    gain, and whether it clears the forward's cost of one more verified token (V's mean slope, module docstring)."""
    cost = (verify_cost[-1] - 1.0) / (len(verify_cost) - 1)
    k = max(len(rates) for modes in acceptance.values() for rates in modes.values())
    lines = [f"one more verified token costs the forward {cost:.3f} one-token passes (mean slope of V) "
             f"(V(t) = {', '.join(f'{v:.2f}' for v in verify_cost)} for t = 1..{len(verify_cost)})",
             "| category | mode | " + " | ".join(f"{j} drafts" for j in range(1, k + 1)) + " | best gain per extra draft | clears the cost |",
             "|---|---|" + "---|" * k + "---|---|"]
    for category, modes in acceptance.items():
        for mode, rates in modes.items():
            gains = [rates[j] - rates[j - 1] for j in range(1, len(rates))]
            best = max(gains) if gains else 0.0
            lines.append(f"| {category} | {mode} | " + " | ".join(f"{r:.3f}" for r in rates)
                         + f" | {best:.3f} | {'yes' if best > cost else 'no'} |")
    return lines
