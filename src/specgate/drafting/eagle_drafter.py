"""Draft with the EAGLE head (specgate.drafting.eagle) on the target's own final-norm features, for one request
(`EagleDrafter`, a Drafter) or many at once (`EagleProposer`, the scheduler's: one head cache, a slot per request).

The feature flow (Drafter.wants_features; the engine asks the target's passes for final-norm states only then):
  prefill       the states after the prompt's tokens but its last (positions 0..P-2)         -> HeadState.observe
  verification  the states after the last committed token and the accepted drafts (L-1..L-1+n) -> HeadState.observe
The head's cache row j holds (h_j, x_{j+1}): the target's state at j and the token after it. With the context
x_0..x_{L-1} committed, h_0..h_{L-2} are known; a proposal feeds every row not yet fed from the target's states
(HeadState.fed..L-2) in ONE head step, and the last row's output drafts x_L. Each further draft feeds the head's
own output feature with the token just drafted at the next row (L-1, L, ...). Those rows are scratch: the next
proposal writes them again from the target's states, so a rejected draft needs no undo (the cache is indexed by
absolute position, like the target's).

q: the head's logits over its d2t vocabulary processed with the request's SamplingParams and sampled by the draft
model's own sampler (model_drafter.sample_draft_ids). It stays on the d2t columns, zero elsewhere (a SparseProbs:
the verifier reads 12,288 columns, not 262,144); the target's residual (p - q)+ covers the rest, so verification
stays exact. Greedy: argmax, q one-hot (None).

Prompt lookup first: where the context's last n >= lookup_min_n tokens (n up to 3) occurred before, a request's
proposal is what followed them (specgate.drafting.ngram; q one-hot, no head step), and the head drafts only where
the context has no such match. Small models' greedy text repeats itself and grounded answers copy their prompt;
there a lookup's chain is long and free, where the head's is one token deep. A sampled request matches from 3
tokens (LOOKUP_MIN_N_SAMPLED). Exact whatever the rule: the choice depends on the context and the request's
params only, and each draft's q is the distribution it was drawn from (one-hot for a lookup).
lookup_min_n 0 turns lookup off (the head alone).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specgate.drafting.base import DraftProposal, Drafter
from specgate.drafting.eagle import FEATURE_FINAL_NORM, EagleHead, drafting_step
from specgate.drafting.model_drafter import sample_draft, sample_draft_ids
from specgate.drafting.ngram import NgramDrafter
from specgate.sampling import SparseProbs

# A chain stops once the product of the head's top-1 probabilities along it falls below this: the next draft would
# likely be rejected, and a rejected draft costs a head step and a verified position for nothing. gamma is then the
# longest chain. Exact whatever the rule: a chain's length depends only on the drafts so far, never on the target.
STOP_BELOW = 0.3

# Prompt lookup drafts where the context's last LOOKUP_MIN_N..LOOKUP_MAX_N tokens occurred before (module docstring).
# 2, not 1: a single repeated token predicts its successor too poorly at temperature 1, where the head did better.
LOOKUP_MIN_N, LOOKUP_MAX_N = 2, 3
# When sampling, a lookup's one-hot draft passes with probability p(x) only, and a 2-token match is often a common
# phrase continued from the wrong place: sampled requests match from 3 tokens (greedy from LOOKUP_MIN_N).
LOOKUP_MIN_N_SAMPLED = 3

# sample(logits `# [B', V_d]`, request indices [B']) -> (tokens `# [B']` target ids, q: B' rows `# [V_t]` (None for a
# greedy row), or None when every row is greedy)
Sampler = Callable[[Tensor, list[int]], tuple[Tensor, Tensor | None]]


def lookup_index(min_n: int) -> NgramDrafter | None:
    """A request's prompt-lookup index matching min_n..LOOKUP_MAX_N tokens, or None for min_n 0 (the head alone)."""
    return NgramDrafter(min_n, LOOKUP_MAX_N) if min_n else None


def lookup_floor(params: Any) -> int | None:
    """The shortest match a request's lookup takes beyond the drafter's own: LOOKUP_MIN_N_SAMPLED when it samples."""
    return None if params.greedy else LOOKUP_MIN_N_SAMPLED


def check_runtime_features(head: EagleHead) -> None:
    """Refuse a head that reads features the runtime's passes do not give (they give the final-norm state only)."""
    if tuple(head.config.feature_layers) != (FEATURE_FINAL_NORM,):
        raise ValueError(
            f"this EAGLE head reads target layers {list(head.config.feature_layers)}, but specgate's decode passes give the "
            f"final-norm state only: use a head trained on the feature set 'final' (feature_layers [{FEATURE_FINAL_NORM}])"
        )


@dataclass(eq=False)
class HeadState:
    """One request's head state: the target's final-norm states by absolute position, and how far they were fed."""

    features: Tensor  # [S, H] float32: the target's state after the token at each position (valid below `known`)
    known: int = 0  # positions 0..known-1 hold target states
    fed: int = 0  # head cache rows 0..fed-1 hold target-fed (h_j, x_{j+1}); rows from fed on are scratch (drafts)
    lookup: NgramDrafter | None = None  # the request's prompt-lookup index, or None (lookup off)

    def observe(self, start: int, features: Tensor) -> None:
        """The target's states features [T, H] at positions start..start+T-1 (after committed tokens)."""
        if start > self.known:
            raise ValueError(f"target features start at position {start} but only 0..{self.known - 1} are known: pass them without gaps")
        count = int(features.shape[0])
        self.features[start : start + count] = features
        self.known = max(self.known, start + count)
        self.fed = min(self.fed, start)  # rows fed from earlier states at these positions are fed again


class EagleProposer:
    """Draft with the head for many requests at once: one head KV cache of num_slots slots, positions absolute.
    Each chain is up to gamma long and stops early where the head is unsure (stop_below; 0: always gamma). A request
    whose context has a lookup match (lookup_min_n; 0: off) drafts that match's continuation instead.

    `wants_features`: the scheduler keeps a HeadState per request (new_state) and feeds it the target's states.
    """

    wants_features = True

    def __init__(self, head: EagleHead, target_vocab_size: int, num_slots: int, max_seq_len: int, name: str = "eagle",
                 stop_below: float = STOP_BELOW, lookup_min_n: int = LOOKUP_MIN_N) -> None:
        check_runtime_features(head)
        if not 0.0 <= stop_below < 1.0:
            raise ValueError(f"stop_below={stop_below}: use a probability in [0, 1) (0: every chain drafts gamma tokens)")
        if isinstance(lookup_min_n, bool) or not isinstance(lookup_min_n, int) or not 0 <= lookup_min_n <= LOOKUP_MAX_N:
            raise ValueError(f"lookup_min_n={lookup_min_n!r}: use an integer in 0..{LOOKUP_MAX_N} (the shortest n-gram a lookup matches; 0: the head alone)")
        self.lookup_min_n = lookup_min_n
        self.head, self.name = head, name
        self.target_vocab_size, self.max_seq_len = int(target_vocab_size), int(max_seq_len)
        self.cache = head.new_cache(num_slots, max_seq_len)
        self.step = drafting_step(head)  # the C kernels' step where they run
        self.stop_below = float(stop_below)

    def new_state(self) -> HeadState:
        return HeadState(torch.zeros(self.max_seq_len, self.head.config.hidden_size), lookup=lookup_index(self.lookup_min_n))

    def begin(self, slot: int) -> None:
        """A request takes `slot`: nothing to reset (its HeadState starts unfed, so its rows are written again)."""

    def propose(
        self,
        slots: Sequence[int],
        states: Sequence[HeadState],
        contexts: Sequence[Tensor],
        gammas: Sequence[int],
        params: Sequence[Any],
        generators: Sequence[torch.Generator | None],
    ) -> list[DraftProposal]:
        """Draft gammas[i] tokens after contexts[i] `# [L_i]` for the request in slots[i] with head state states[i],
        sampled with its params[i] and generators[i]: a lookup's continuation where its context has a match (q
        one-hot: draft_probs None), else the head's chain, whose draft_probs is its q `# [G', V_d']` on the d2t
        columns (a SparseProbs; a dense [G', V_t] when the head has no map; None for greedy rows).
        forward_passes: the head steps the chain took (a batch shares them), 0 for a lookup."""
        d2t = self.head.d2t

        def sample(logits: Tensor, rows: list[int]) -> tuple[Tensor, Tensor | None]:
            drawn = [sample_draft_ids(logits[k : k + 1], params[i], generators[i]) for k, i in enumerate(rows)]
            ids = torch.cat([t for t, _ in drawn])
            return (ids if d2t is None else d2t[ids]), [None if q is None else q[0] for _, q in drawn]  # greedy rows: no q

        def draft_probs(qs: list[Tensor]) -> Tensor | SparseProbs | None:
            if not qs:
                return None
            return torch.stack(qs) if d2t is None else SparseProbs(torch.stack(qs), d2t)  # [G', V_d'] on d2t's columns

        lookups = [state.lookup.propose(context, gamma, lookup_floor(param)).tokens if state.lookup is not None and gamma > 0 else None
                   for state, context, gamma, param in zip(states, contexts, gammas, params)]
        looked_up = [found is not None and found.numel() > 0 for found in lookups]
        tokens, probs = self.draft(slots, states, contexts, [0 if hit else gamma for hit, gamma in zip(looked_up, gammas)], sample)
        return [DraftProposal(tokens=found, draft_probs=None) if hit
                else DraftProposal(tokens=torch.tensor(row, dtype=torch.int64), draft_probs=draft_probs(qs), forward_passes=len(row))
                for row, qs, found, hit in zip(tokens, probs, lookups, looked_up)]

    @torch.inference_mode()
    def draft(self, slots: Sequence[int], states: Sequence[HeadState], contexts: Sequence[Tensor], gammas: Sequence[int],
              sample: Sampler) -> tuple[list[list[int]], list[list[Tensor]]]:
        """The draft chains: per request its tokens (target ids) and its per-token q (sampling rows). A request with
        gamma 0 or a context of one token (no target state yet) drafts nothing; one whose head logits are not
        finite stops drafting."""
        tokens: list[list[int]] = [[] for _ in slots]
        probs: list[list[Tensor]] = [[] for _ in slots]
        rows = [i for i, gamma in enumerate(gammas) if gamma > 0 and contexts[i].numel() >= 2]
        if not rows:
            return tokens, probs
        logits, out = self._catch_up([slots[i] for i in rows], [states[i] for i in rows], [contexts[i] for i in rows])
        confidence = torch.ones(len(rows))  # [B'] the head's own estimate that the chain so far is accepted
        sharpen = float(self.head.config.sample_temperature)
        for step in range(max(gammas[i] for i in rows)):
            finite = torch.isfinite(logits).all(dim=-1)  # [B']: NaN/inf head logits end a row's chain
            if not bool(finite.all()):
                rows, logits, out, confidence = [i for i, ok in zip(rows, finite.tolist()) if ok], logits[finite], out[finite], confidence[finite]
                if not rows:
                    break
            # sampled rows draw from q at the head's sample_temperature (EagleConfig); argmax is unchanged by it
            drafted, q = sample(logits if sharpen == 1.0 else logits / sharpen, rows)  # [B'], [B', V_t] or None
            for k, i in enumerate(rows):
                tokens[i].append(int(drafted[k]))
                if q is not None and q[k] is not None:
                    probs[i].append(q[k])
            more = [k for k, i in enumerate(rows) if step + 1 < gammas[i]]
            if self.stop_below > 0 and more:
                confidence = confidence * torch.softmax(logits.float(), -1).amax(-1)  # [B'] product of top-1 probabilities
                sure = (confidence >= self.stop_below).tolist()  # one read of the batch, not one per row
                more = [k for k in more if sure[k]]
            if not more:
                break
            rows, confidence = [rows[k] for k in more], confidence[more]
            positions = torch.tensor([[contexts[i].numel() - 1 + step] for i in rows])  # [B', 1]
            chosen = torch.tensor(more)
            logits, out = self.step(drafted[chosen][:, None], out[chosen][:, None], positions, self.cache, torch.tensor([slots[i] for i in rows]))
            logits, out = logits[:, 0], out[:, 0]  # [B', V_d], [B', H]
        return tokens, probs

    def _catch_up(self, slots: list[int], states: list[HeadState], contexts: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Feed each request's rows from its first unfed one through L-2 (the target's states and the tokens after
        them) in one ragged head step; each row's last logits `# [B, V_d]` and output feature `# [B, H]`."""
        lasts = [int(context.numel()) - 2 for context in contexts]  # the row whose output drafts x_L
        for state, last in zip(states, lasts):
            if state.known <= last:
                raise RuntimeError(f"the EAGLE head needs the target's state at position {last} but knows 0..{state.known - 1}: "
                                   "the engine must pass each verified position's state to observe_features (Drafter.wants_features)")
        starts = [min(state.fed, last) for state, last in zip(states, lasts)]  # always feed >= 1 row
        counts = [last - start + 1 for start, last in zip(starts, lasts)]
        batch, width = len(contexts), max(counts)
        ids = torch.zeros(batch, width, dtype=torch.int64)  # [B, T]
        positions = torch.full((batch, width), -1, dtype=torch.int64)  # [B, T]
        features = torch.zeros(batch, width, 1, self.head.config.hidden_size)  # [B, T, 1, H]
        for row, (state, context, start, last, count) in enumerate(zip(states, contexts, starts, lasts, counts)):
            ids[row, :count] = context[start + 1 : last + 2]
            positions[row, :count] = torch.arange(start, last + 1)
            features[row, :count, 0] = state.features[start : last + 1]
            state.fed = last + 1
        logits, out = self.step(ids, self.head.project_target(features), positions, self.cache, torch.tensor(slots))
        index = (torch.arange(batch), torch.tensor(counts) - 1)
        return logits[index], out[index]


class EagleDrafter(Drafter):
    """One request's EAGLE drafter (engine.generate): an EagleProposer of one slot and the request's HeadState.

    head: an EagleHead attached to target (eagle.load_head). target: the LoadedModel it drafts for (its vocabulary
    size; its model computes the features for sample_batch).
    """

    wants_features = True

    def __init__(self, head: EagleHead, target: Any, name: str = "eagle", stop_below: float = STOP_BELOW,
                 lookup_min_n: int = LOOKUP_MIN_N) -> None:
        check_runtime_features(head)
        self.head, self.target, self.name, self.stop_below = head, target, name, float(stop_below)
        self.lookup_min_n = lookup_min_n
        self.target_vocab_size = int(target.model.vocab_size)

    def begin(self, prompt_ids, params, generator, max_seq_len) -> None:
        super().begin(prompt_ids, params, generator, max_seq_len)
        limit = int(self.head.config.max_position_embeddings)
        if max_seq_len > limit:
            raise ValueError(f"the request needs {max_seq_len} positions but the EAGLE head supports {limit}: lower max_new_tokens or shorten the prompt")
        self.proposer = EagleProposer(self.head, self.target_vocab_size, 1, max_seq_len, self.name, self.stop_below, self.lookup_min_n)
        self.state = self.proposer.new_state()

    def observe_features(self, start: int, features: Tensor) -> None:
        self.state.observe(start, features)

    def propose(self, context_ids: Tensor, gamma: int) -> DraftProposal:
        # forward_passes: one head step per head draft (the first also feeds the new rows)
        return self.proposer.propose([0], [self.state], [context_ids], [gamma], [self.params], [self.generator])[0]

    @torch.inference_mode()
    def sample_batch(self, contexts: Tensor, gamma: int, params: Any, generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
        """Draft up to gamma tokens after each of B equal-length contexts [B, T] at once, as the engine would after
        prefilling them (the target's states at positions 0..T-2 known), with one generator: tokens [B, G] (-1
        after a lookup shorter than G) and q [B, G, V_t] (None when greedy; one-hot on a lookup's tokens, zero on
        its padding). A context with a lookup match drafts its continuation, as propose does; the head's chains
        run gamma long. For statistical checks (engine.lossless_real)."""
        batch, length = contexts.shape
        unique, inverse = torch.unique(contexts, dim=0, return_inverse=True)  # the target runs once per distinct context
        found = [self._lookup(context, gamma, params) for context in unique]  # per distinct context: its lookup or None
        heads = [u for u, drafts in enumerate(found) if drafts is None]  # the distinct contexts the head drafts after
        states: list[HeadState | None] = [None] * batch  # lookup rows draft no head step: no state
        if heads:
            model = self.target.model
            positions = torch.arange(length)[None].expand(len(heads), length)  # [U', T]
            hidden = model.forward(unique[heads], positions, model.new_cache(len(heads), length), torch.arange(len(heads)),
                                   logits=False, return_hidden=True).float()  # [U', T, H]
            where = {u: k for k, u in enumerate(heads)}
            states = [HeadState(hidden[where[u]], known=length - 1) if u in where else None for u in inverse.tolist()]  # shared views, never written
        proposer = EagleProposer(self.head, self.target_vocab_size, batch, length + gamma, self.name, stop_below=0.0, lookup_min_n=0)

        def sample(logits: Tensor, rows: list[int]) -> tuple[Tensor, Tensor | None]:
            return sample_draft(logits, params, generator, self.head.d2t, self.target_vocab_size)

        gammas = [0 if found[u] is not None else gamma for u in inverse.tolist()]
        chains, probs = proposer.draft(list(range(batch)), states, list(contexts), gammas, sample)
        tokens = torch.full((batch, gamma), -1, dtype=torch.int64)  # [B, G]
        draft_probs = None if params.greedy else torch.zeros(batch, gamma, self.target_vocab_size)  # [B, G, V_t]
        for row, u in enumerate(inverse.tolist()):
            chain = chains[row] if found[u] is None else found[u]
            tokens[row, : len(chain)] = torch.tensor(chain, dtype=torch.int64)
            if draft_probs is not None and found[u] is None:
                draft_probs[row] = torch.stack(probs[row])
            elif draft_probs is not None:
                draft_probs[row, torch.arange(len(chain)), tokens[row, : len(chain)]] = 1.0
        return tokens, draft_probs

    def _lookup(self, context: Tensor, gamma: int, params: Any) -> list[int] | None:
        """The lookup's drafts after context [T] (what propose would draft), or None where it has no match."""
        lookup = lookup_index(self.lookup_min_n)
        if lookup is None:
            return None
        lookup.begin(context, params, None, context.numel() + gamma)
        drafts = lookup.propose(context, gamma, lookup_floor(params)).tokens.tolist()
        return drafts or None


class HeadCostProxy:
    """The head as calibrate_cost_model times a draft model: `forward` is one head step (zero features), so the
    adaptive policy prices an EAGLE draft pass at what it costs."""

    def __init__(self, head: EagleHead) -> None:
        self.head = head
        self.step = drafting_step(head)
        self.vocab_size = head.config.draft_vocab_size

    def new_cache(self, num_slots: int, max_seq_len: int) -> Any:
        return self.head.new_cache(num_slots, max_seq_len)

    def forward(self, input_ids: Tensor, positions: Tensor, cache: Any, slots: Tensor, *, logits: bool = True, out: Tensor | None = None) -> Tensor | None:
        feature = torch.zeros(*input_ids.shape, self.head.config.hidden_size)  # [B, T, H]
        scores, _ = self.step(input_ids, feature, positions, cache, slots)  # [B, T, V_d]
        if not logits:
            return None
        return scores if out is None else out.copy_(scores)
