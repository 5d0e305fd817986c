"""Closed-loop clients: C clients with no think time, each finished request replaced at once by the client's next."""

from __future__ import annotations

import random

import torch

from specgate.sampling import SamplingParams
from specgate.serving import Request, Scheduler


class ClosedLoop:
    """C clients of one scheduler, greedy, EOS ignored (every request runs to its max_tokens).

    Each request's max_tokens is uniform in max_tokens * (1 +- spread): with one length for all, the C requests of
    a closed loop without speculation finish in the same step and prefill together, in waves. sequenced=True: the
    k-th request sent gets prompt k (mod the prompts) and the k-th length, whichever client sends it, so servers
    fed by loops of one seed serve the same sequence of requests; otherwise a client's prompt depends on which
    client it is (and so on the order in which clients finished)."""

    def __init__(self, scheduler: Scheduler, prompts: list[torch.Tensor], concurrency: int, max_tokens: int, spread: float = 0.0,
                 seed: int = 0, sequenced: bool = False) -> None:
        if not 0.0 <= spread < 1.0:
            raise ValueError(f"spread={spread} is out of range [0, 1): max_tokens varies uniformly in max_tokens * (1 +- spread)")
        self.scheduler, self.prompts, self.max_tokens, self.spread = scheduler, prompts, max_tokens, spread
        self.sequenced = sequenced
        self.rng = random.Random(seed)
        self.sent = 0
        self.finished = 0
        self.issued: dict[str, list[int]] = {}  # request_id -> [prompt index, max_tokens], in the order sent
        self.requests: dict[str, Request] = {}  # request_id -> the request (its finish_reason once done)
        for client in range(concurrency):
            self.submit(client)

    def submit(self, client: int) -> None:
        index = (self.sent if self.sequenced else client + self.sent) % len(self.prompts)
        low, high = round(self.max_tokens * (1 - self.spread)), round(self.max_tokens * (1 + self.spread))
        length = max(1, self.rng.randint(low, high))
        request = Request(self.prompts[index], SamplingParams(temperature=0.0), max_tokens=length, ignore_eos=True, seed=self.sent)
        request.sink = lambda event, client=client: self.done(client) if event[0] == "done" else None
        self.sent += 1
        self.scheduler.submit(request)
        self.issued[request.request_id] = [index, length]
        self.requests[request.request_id] = request

    def done(self, client: int) -> None:  # called on the scheduler's thread, inside scheduler.step()
        self.finished += 1
        self.submit(client)
