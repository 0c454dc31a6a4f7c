"""Gradient synchronisation of one step: the tied-embedding sum and the data-parallel sum, in flat buckets
started as soon as their gradients are final and waited for only before the optimizer step.

Hand-written rather than DistributedDataParallel: DDP owns the forward and assumes one backward per step,
while a pipeline stage runs many micro-batch backwards (and I/W halves) in an order only the schedule knows.
Here the runtime tells us when a stage's last backward runs; within it, post-accumulate hooks start each
bucket the moment its last gradient lands, so the reduction overlaps the rest of that backward.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from parallel.collectives import all_reduce_, group_size
from parallel.pipeline.actions import Action, Kind

Group = dist.ProcessGroup | None


@dataclass
class Bucket:
    """Parameters whose gradients are reduced together as one flat tensor over `groups`, in order.

    A bucket without a rider keeps its gradients as views of one persistent flat tensor (`storage`), as DDP's
    `gradient_as_bucket_view` does: autograd accumulates into the views, the reduction runs on `storage` in place,
    and nothing is copied in or out (the copies were 4% of a dp2 step on CPU)."""

    params: list[nn.Parameter]
    groups: tuple[Group, ...]
    pending: set[int] = field(default_factory=set)  # ids of params whose gradient is not final yet
    flat: torch.Tensor | None = None
    work: dist.Work | None = None
    rider: Callable[[], torch.Tensor] | None = None  # float64 values summed along (the step's loss sums)
    carried: torch.Tensor | None = None  # the rider's sum, after `unflatten`
    storage: torch.Tensor | None = None  # the gradients' flat home between `attach_grads` and the step's end

    def attach_grads(self) -> None:
        """Zero the flat storage and make each parameter's gradient a view of its slice (before the first backward)."""
        first = self.params[0]
        if self.storage is None:
            self.storage = torch.zeros(sum(p.numel() for p in self.params), dtype=first.dtype, device=first.device)
        else:
            self.storage.zero_()
        for p, view in zip(self.params, self._views()):
            p.grad = view

    def _views(self) -> list[torch.Tensor]:
        offset, views = 0, []
        for p in self.params:
            views.append(self.storage[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def flatten(self) -> torch.Tensor:
        """Every gradient in one tensor; a parameter without one contributes zeros, so ranks stay in step."""
        if self.storage is not None and self.rider is None:
            for p, view in zip(self.params, self._views()):
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():  # a gradient rebound by hand is copied
                    view.copy_(p.grad) if p.grad is not None else view.zero_()
                    p.grad = view
            return self.storage
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params]
        if self.rider is None:
            return torch.cat(grads)
        # With a rider the bucket travels in float64: the loss sums sum as exactly as they always did, and each
        # gradient is rounded back once (at dp 2 that equals the float32 sum bit for bit).
        return torch.cat([*(g.double() for g in grads), self.rider().double().reshape(-1)])

    def unflatten(self) -> None:
        """Write the reduced values back into each parameter's gradient (and keep the rider's sum)."""
        if self.flat is not self.storage:  # a view bucket's gradients already hold the reduced values
            offset = 0
            for p in self.params:
                part = self.flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = part.to(p.dtype)
                else:
                    p.grad.copy_(part)
            self.carried = self.flat[offset:].clone() if self.rider is not None else None
        self.flat = self.work = None


def split_buckets(params: list[nn.Parameter], bucket_bytes: int, groups: tuple[Group, ...]) -> list[Bucket]:
    """Consecutive parameters (in the order their gradients become final) packed up to `bucket_bytes`."""
    buckets: list[Bucket] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > bucket_bytes or buckets[-1].params[0].dtype != p.dtype:
            buckets.append(Bucket([], groups))
            size = 0
        buckets[-1].params.append(p)
        size += nbytes
    return buckets


@dataclass(frozen=True)
class Rider:
    """The step's loss and aux sums: summed over DP (inside a gradient bucket) and over the pipeline group."""

    values: Callable[[], torch.Tensor]  # this process's float64 sums, final after its last F
    forwards: int  # F actions this process runs in a step
    pp_group: Group = None
    # Whether the pipeline sum may start mid-step, beside the boundary transfers. gloo runs each op on its
    # own; NCCL would queue it among P2P kernels in an order that differs between ranks, so it waits there.
    pp_early: bool = False


# The most gradient elements the rider may take along in float64. Beyond it a bucket of the sums alone is cheaper: an
# extra all-reduce of a few bytes, started after the last F, against a float64 concatenation, a reduction of twice
# the bytes and a copy back of every gradient in the bucket (with 25 MB buckets a small model is one bucket, all of
# it carried: 1.26x DDP's dp2 step at hidden 128, 2 layers, issue 39).
CARRIED_MAX_NUMEL = 1 << 14


def carrier_of(order: list[Bucket], dp_group: Group) -> Bucket | None:
    """The bucket the rider travels in: the smallest bucket reduced over DP alone if it is small enough to carry in
    float64 (`CARRIED_MAX_NUMEL`), else a new bucket of no parameters (the caller puts it first); None at dp 1."""
    if group_size(dp_group) == 1:
        return None
    plain = [b for b in order if len(b.groups) == 1 and b.groups[0] is dp_group]
    smallest = min(plain, key=lambda b: sum(p.numel() for p in b.params), default=None)
    if smallest is not None and sum(p.numel() for p in smallest.params) <= CARRIED_MAX_NUMEL:
        return smallest
    return Bucket([], (dp_group,))


def weak_hook(method: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
    """A parameter hook that calls `method` while its object lives. A parameter keeps its hooks where Python's
    collector cannot follow (in C++), so a bound-method hook closes a cycle (parameter -> hook -> sync ->
    parameter) that is never collected: every engine built in a process, with its process groups, would live on."""
    ref = weakref.WeakMethod(method)

    def hook(param: nn.Parameter) -> None:
        if (bound := ref()) is not None:
            bound(param)
    return hook


class GradientSync:
    """Buckets per stage; `before`/`after` are the runtime's compute hooks, `finish` completes the step.

    Buckets launch strictly in one fixed order (stages by when their gradients become final, then bucket
    order): collectives match by order on a group, and a replica whose expert got no tokens in the last
    micro-batch must not launch its buckets in a different order than its peers.

    The step's loss and aux sums ride in one DP bucket (the carrier): the smallest one if it is tiny, else a bucket
    of the sums alone at the head of the order (`carrier_of`), so a step issues no DP collective but its buckets.
    The carrier launches only once this process has run its last F (the sums are final then); in every schedule
    that is before any stage's final backward, so nothing waits.
    Over the pipeline group the sums need a collective of their own; at dp 1 on gloo it too starts after the
    last F and is done by the step's end, elsewhere it runs in `step_sums`."""

    def __init__(self, buckets: dict[int, list[Bucket]], final_actions: dict[int, Action], rider: Rider,
                 local_tie: tuple[nn.Parameter, nn.Parameter] | None = None, dp_group: Group = None):
        self.buckets = buckets  # stage -> its buckets; dict order = launch order of the stages
        self.order = [b for stage_buckets in buckets.values() for b in stage_buckets]
        self.final_actions = final_actions  # stage -> the compute after which its gradients are final
        self.local_tie = local_tie  # emulation: both tied copies live here; summed in `finish`, then over DP
        self.dp_group = dp_group
        self.launched = 0  # buckets of `order` launched this step
        self.ready: set[int] = set()  # ids of buckets whose gradients are final this step
        self.armed: dict[int, Bucket] = {}  # id(param) -> its bucket, during its stage's final backward
        for bucket in self.order:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(weak_hook(self._on_grad))
        self.rider = rider
        self.carrier = carrier_of(self.order, dp_group)
        if self.carrier is not None:
            self.carrier.rider = rider.values
            if not self.carrier.params:  # the sums alone: first in line, launched once the last F has run
                self.order.insert(0, self.carrier)
        # Without a DP carrier (dp 1) the sums start over the pipeline group once final, where that may run
        # beside the transfers; the step's end then finds them summed instead of waiting for a collective.
        self.pp_early = (rider.pp_early and self.carrier is None and group_size(dp_group) == 1
                         and group_size(rider.pp_group) > 1)
        self.pp_sums: tuple[torch.Tensor, dist.Work] | None = None
        self.forwards = rider.forwards
        self.forwards_left = 0  # F actions still to run this step: the carrier waits for none to be left
        self.first_launch_s: float | None = None  # perf_counter times of the last step, for tests and traces
        self.last_backward_end_s: float | None = None
        self.sums_launch_s: float | None = None  # when the pipeline sum of the loss sums started early

    def start_step(self) -> None:
        """Forget the previous step's launches and timings; give the buckets' gradients their flat homes."""
        self.launched, self.ready, self.armed, self.pp_sums = 0, set(), {}, None
        if self.carrier is not None and not self.carrier.params:
            self.ready.add(id(self.carrier))  # no gradient to wait for: only the last F
        for bucket in self.order:
            if bucket.rider is None:  # the carrier travels in float64: its gradients cannot be views of it
                bucket.attach_grads()
        self.forwards_left = self.forwards
        self.first_launch_s = self.last_backward_end_s = self.sums_launch_s = None

    def step_sums(self) -> torch.Tensor:
        """The rider's values summed over DP and the pipeline (float64); call after `finish`."""
        if self.pp_sums is not None:
            sums, work = self.pp_sums
            work.wait()
            return sums
        sums = self.carrier.carried if self.carrier is not None else all_reduce_(self.rider.values(), self.dp_group)
        return all_reduce_(sums, self.rider.pp_group)

    def before(self, action: Action) -> None:
        """Arm the stage's hooks right before its final full backward (an I/W stage launches after its W)."""
        if action.kind is Kind.B and self.final_actions.get(action.stage) == action:
            for bucket in self.buckets.get(action.stage, []):
                bucket.pending = {id(p) for p in bucket.params}
                self.armed.update((id(p), bucket) for p in bucket.params)

    def after(self, action: Action) -> None:
        """After a stage's final backward compute every gradient of it is final: launch what is left."""
        if action.kind in (Kind.B, Kind.I, Kind.W):
            self.last_backward_end_s = time.perf_counter()
        if action.kind is Kind.F:
            self.forwards_left -= 1
            if self.forwards_left == 0:
                self._launch_ready()  # the carrier may be waiting for the sums
                if self.pp_early:
                    sums = self.rider.values()
                    self.pp_sums = sums, dist.all_reduce(sums, group=self.rider.pp_group, async_op=True)
                    self.sums_launch_s = time.perf_counter()
        if self.final_actions.get(action.stage) == action:
            self.ready.update(id(b) for b in self.buckets.get(action.stage, []))
            self._launch_ready()

    def _on_grad(self, param: nn.Parameter) -> None:
        bucket = self.armed.pop(id(param), None)
        if bucket is not None:
            bucket.pending.discard(id(param))
            if not bucket.pending:
                self.ready.add(id(bucket))
                self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch, in the fixed order, every bucket up to the first one that is not ready."""
        while self.launched < len(self.order) and self._launchable(self.order[self.launched]):
            self._launch(self.order[self.launched])
            self.launched += 1

    def _launchable(self, bucket: Bucket) -> bool:
        return id(bucket) in self.ready and (bucket is not self.carrier or self.forwards_left <= 0)

    def _launch(self, bucket: Bucket) -> None:
        """Start the bucket's first reduction without waiting (a chain's later groups follow in `finish`)."""
        if self.first_launch_s is None:
            self.first_launch_s = time.perf_counter()
        bucket.flat = bucket.flatten()
        group = bucket.groups[0]
        bucket.work = dist.all_reduce(bucket.flat, group=group, async_op=True) if group_size(group) > 1 else None

    def finish(self) -> None:
        """Launch anything not yet started, wait for every reduction in order, write the sums back."""
        self.ready.update(id(b) for b in self.order)
        self.forwards_left = 0
        self._launch_ready()
        for bucket in self.order:
            if bucket.work is not None:
                bucket.work.wait()
            for group in bucket.groups[1:]:  # a chain (embedding group, then DP) runs its later sums in order
                if group_size(group) > 1:
                    dist.all_reduce(bucket.flat, group=group)
            bucket.unflatten()
        if self.local_tie is not None:
            self._sum_local_tie()

    def _sum_local_tie(self) -> None:
        """Emulation: the embedding group's sum in place, then one DP sum shared by both copies (bitwise equal)."""
        first, head = self.local_tie
        first.grad = first.grad + head.grad
        total = Bucket([first], (self.dp_group,))
        self._launch(total)
        if total.work is not None:
            total.work.wait()
        total.unflatten()
        head.grad = first.grad.clone()
