"""flashtile.distributed: ring attention over gloo, in 2 and 4 spawned processes on the CPU.

One spawn per world size runs every case (process start-up dominates the time); each rank saves its shard of out,
lse, dq, dk, dv and the point-to-point operations it posted. The parent process puts the shards back together and
checks them against the float64 oracle on the gathered sequence by the eager rule: the ring's float32 error is at
most 2 x the error of flashtile's single-process float32 attention (torch backend) + a rounding floor
(conftest.assert_close_to_oracle). The processes meet through a file:// rendezvous in tmp_path (no network
port), every collective has a 30 s timeout and the parent stops waiting after 120 s. The varlen ring
(ring_flash_attn_varlen_func) runs in the same processes on packed batches whose every sequence is sharded over
the ranks (one of them empty), against the oracle on each gathered sequence and flashtile's single-process
flash_attn_varlen_func on the gathered packed batch, by the same rule.
"""

from __future__ import annotations

import datetime
import importlib.util
import pathlib
import time
import traceback
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashtile
from conftest import assert_close_to_oracle
from flashtile.distributed import (contiguous_shard, contiguous_shard_varlen, contiguous_unshard,
                                   contiguous_unshard_varlen, ring_flash_attn_func, ring_flash_attn_varlen_func,
                                   shard_cu_seqlens, zigzag_shard, zigzag_shard_varlen, zigzag_unshard,
                                   zigzag_unshard_varlen)
from flashtile.reference import flash_attn_reference

BATCH, SEQLEN_LOCAL, HEADDIM = 2, 8, 16
SHARD = {"contiguous": contiguous_shard, "zigzag": zigzag_shard}
UNSHARD = {"contiguous": contiguous_unshard, "zigzag": zigzag_unshard}

# name: (world sizes, layout, causal, nheads, nheads_k, headdim_v)
CASES = {
    "full": ((2, 4), "contiguous", False, 2, 2, HEADDIM),
    "causal-contiguous": ((2, 4), "contiguous", True, 2, 2, HEADDIM),
    "causal-zigzag": ((2, 4), "zigzag", True, 2, 2, HEADDIM),
    "gqa-causal-zigzag": ((2,), "zigzag", True, 2, 1, 8),
    "gqa-full": ((4,), "contiguous", False, 2, 1, HEADDIM),
    # windows and ALiBi over global positions (OPTIONS): reaching into neighbouring shards, both sides, both layouts
    "window-causal-zigzag": ((2, 4), "zigzag", True, 2, 2, HEADDIM),
    "window-two-sided-contiguous": ((2, 4), "contiguous", False, 2, 2, HEADDIM),
    "alibi-gqa-causal-contiguous": ((2,), "contiguous", True, 2, 1, HEADDIM),
    "alibi-window-zigzag": ((4,), "zigzag", False, 2, 2, 8),
}
# the cases' other flash_attn_func arguments, passed alike to the ring and to the single-process attention
OPTIONS = {
    "window-causal-zigzag": dict(window_size=(5, 0)),
    "window-two-sided-contiguous": dict(window_size=(3, 9)),
    "alibi-gqa-causal-contiguous": dict(alibi_slopes=torch.tensor([0.5, 0.125])),
    "alibi-window-zigzag": dict(window_size=(6, 2), alibi_slopes=torch.tensor([0.25, 1.0])),
}
BAD_CASES = ("uneven-seqlen", "q-k-mismatch-on-one-rank", "zigzag-odd-seqlen")

# packed batches: every sequence sharded over the ranks; global lengths SEQ_UNITS x 2W (one of them empty)
SEQ_UNITS = (1, 0, 3, 2)
SHARD_VARLEN = {"contiguous": contiguous_shard_varlen, "zigzag": zigzag_shard_varlen}
UNSHARD_VARLEN = {"contiguous": contiguous_unshard_varlen, "zigzag": zigzag_unshard_varlen}
# name: (world sizes, layout, causal, nheads, nheads_k, headdim_v)
VARLEN_CASES = {
    "varlen-full": ((2,), "contiguous", False, 2, 2, HEADDIM),
    "varlen-causal-contiguous": ((2, 4), "contiguous", True, 2, 2, HEADDIM),
    "varlen-causal-zigzag": ((2, 4), "zigzag", True, 2, 2, HEADDIM),
    "varlen-gqa-causal-zigzag": ((2,), "zigzag", True, 4, 2, 8),
    "varlen-gqa-causal-contiguous": ((4,), "contiguous", True, 2, 1, HEADDIM),
    # windows and ALiBi over each sequence's global positions (VARLEN_OPTIONS): each sequence's pairs of chunks
    "varlen-window-causal-zigzag": ((2, 4), "zigzag", True, 2, 2, HEADDIM),
    "varlen-alibi-window-contiguous": ((2,), "contiguous", False, 2, 1, HEADDIM),
    "varlen-alibi-per-sequence-causal-zigzag": ((4,), "zigzag", True, 2, 2, 8),
}
VARLEN_OPTIONS = {
    "varlen-window-causal-zigzag": dict(window_size=(5, 0)),
    "varlen-alibi-window-contiguous": dict(window_size=(3, 6), alibi_slopes=torch.tensor([0.5, 0.125])),
    # (nseq, nheads): a row of slopes per sequence
    "varlen-alibi-per-sequence-causal-zigzag": dict(
        alibi_slopes=torch.tensor([[0.5, 0.25], [1.0, 0.125], [0.0625, 2.0], [0.75, 0.375]])),
}
BAD_VARLEN_CASES = ("varlen-cu-seqlens-differ", "varlen-total-mismatch-on-one-rank", "varlen-zigzag-odd-length",
                    "varlen-slopes-of-another-shape")


def _full_inputs(name: str, world: int):
    """The gathered sequence of a case and the cotangents of out and lse, drawn alike in every process."""
    _, _, _, nheads, nheads_k, headdim_v = CASES[name]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}-{world}".encode()))
    seqlen = world * SEQLEN_LOCAL
    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    q, k, v = (draw(BATCH, seqlen, nheads, HEADDIM), draw(BATCH, seqlen, nheads_k, HEADDIM),
               draw(BATCH, seqlen, nheads_k, headdim_v))
    return q, k, v, draw(BATCH, seqlen, nheads, headdim_v), draw(BATCH, nheads, seqlen)


class _CountingP2P:
    """Wraps dist.batch_isend_irecv: how many calls and operations (isend/irecv of one tensor each) were posted."""

    def __init__(self, original):
        self.original, self.calls, self.ops = original, 0, 0

    def __call__(self, ops):
        self.calls += 1
        self.ops += len(ops)
        return self.original(ops)

    def take(self):
        counts, self.calls, self.ops = (self.calls, self.ops), 0, 0
        return counts


def _run_case(name, rank, world, counter, group=None):
    _, layout, causal, *_ = CASES[name]
    shard = SHARD[layout]
    q, k, v, grad_out, grad_lse = (t.float() for t in _full_inputs(name, world))
    q, k, v = (shard(t, rank, world).requires_grad_() for t in (q, k, v))
    counter.take()
    out, lse = ring_flash_attn_func(q, k, v, group=group, causal=causal, layout=layout, return_lse=True,
                                    **OPTIONS.get(name, {}))
    forward_counts = counter.take()
    loss = (out * shard(grad_out, rank, world)).sum() + (lse * shard(grad_lse, rank, world, dim=2)).sum()
    loss.backward()
    backward_counts = counter.take()
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "forward_p2p": forward_counts, "backward_p2p": backward_counts}


def _varlen_inputs(name: str, world: int):
    """The gathered packed batch of a varlen case, its global cu_seqlens (int32) and the cotangents of out and lse
    (nheads, total), drawn alike in every process."""
    _, _, _, nheads, nheads_k, headdim_v = VARLEN_CASES[name]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}-{world}".encode()))
    lengths = [units * 2 * world for units in SEQ_UNITS]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    total = sum(lengths)
    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    q, k, v = draw(total, nheads, HEADDIM), draw(total, nheads_k, HEADDIM), draw(total, nheads_k, headdim_v)
    return q, k, v, draw(total, nheads, headdim_v), draw(nheads, total), cu


def _run_varlen_case(name, rank, world, counter):
    _, layout, causal, *_ = VARLEN_CASES[name]
    shard = SHARD_VARLEN[layout]
    *tensors, cu = _varlen_inputs(name, world)
    q, k, v, grad_out, grad_lse = (t.float() for t in tensors)
    q, k, v = (shard(t, cu, rank, world).requires_grad_() for t in (q, k, v))
    cu_local = shard_cu_seqlens(cu, world, layout)
    max_seqlen = int((cu_local[1:] - cu_local[:-1]).max())
    counter.take()
    out, lse = ring_flash_attn_varlen_func(q, k, v, cu_local, max_seqlen, causal=causal, layout=layout,
                                           return_lse=True, **VARLEN_OPTIONS.get(name, {}))
    forward_counts = counter.take()
    loss = (out * shard(grad_out, cu, rank, world)).sum() + (lse * shard(grad_lse, cu, rank, world, dim=1)).sum()
    loss.backward()
    backward_counts = counter.take()
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "forward_p2p": forward_counts, "backward_p2p": backward_counts}


def _run_bad_varlen_case(name, rank, world):
    cu = [0, 4, 8]
    if name == "varlen-cu-seqlens-differ" and rank == 1:
        cu = [0, 2, 8]
    if name == "varlen-zigzag-odd-length":
        cu = [0, 3, 8]
    q = torch.randn(8, 2, HEADDIM)
    k = torch.randn(8 + (1 if name == "varlen-total-mismatch-on-one-rank" and rank == 0 else 0), 2, HEADDIM)
    layout = "zigzag" if name == "varlen-zigzag-odd-length" else "contiguous"
    # two sequences and two heads: slopes of (3,) fit neither (nheads,) nor (nseq, nheads)
    slopes = torch.ones(3) if name == "varlen-slopes-of-another-shape" else None
    try:
        ring_flash_attn_varlen_func(q, k, k, torch.tensor(cu, dtype=torch.int32), 5, causal=True, layout=layout,
                                    alibi_slopes=slopes)
    except ValueError as error:
        return f"ValueError: {error}"
    return "no error"


def _run_bad_case(name, rank, world):
    nheads = 2
    seqlen = SEQLEN_LOCAL
    if name == "uneven-seqlen" and rank == 1:
        seqlen = SEQLEN_LOCAL // 2
    if name == "zigzag-odd-seqlen":
        seqlen = SEQLEN_LOCAL - 1
    q = torch.randn(BATCH, seqlen, nheads, HEADDIM)
    k = torch.randn(BATCH, seqlen + (1 if name == "q-k-mismatch-on-one-rank" and rank == 0 else 0), nheads, HEADDIM)
    v = torch.randn(k.shape)
    layout = "zigzag" if name == "zigzag-odd-seqlen" else "contiguous"
    try:
        ring_flash_attn_func(q, k, v, causal=True, layout=layout)
    except ValueError as error:
        return f"ValueError: {error}"
    return "no error"


def _worker(rank, world, init_file, results_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    counter = _CountingP2P(dist.batch_isend_irecv)
    dist.batch_isend_irecv = counter
    results = {}
    try:
        with flashtile.use_backend("torch"):
            for name, (worlds, *_) in CASES.items():
                if world in worlds:
                    results[name] = _run_case(name, rank, world, counter)
            for name, (worlds, *_) in VARLEN_CASES.items():
                if world in worlds:
                    results[name] = _run_varlen_case(name, rank, world, counter)
            if world == 2:
                for name in BAD_CASES:
                    results[name] = _run_bad_case(name, rank, world)
                for name in BAD_VARLEN_CASES:
                    results[name] = _run_bad_varlen_case(name, rank, world)
                # the group still works after the refusals
                results["after-refusals"] = _run_case("full", rank, world, counter)
            if world == 4:
                # a ring over a subgroup: its ranks 0 and 1 are the global ranks 1 and 3
                subgroup = dist.new_group([1, 3])
                if rank in (1, 3):
                    results["subgroup"] = _run_case("causal-zigzag", dist.get_rank(subgroup), 2, counter,
                                                    group=subgroup)
    except Exception:
        results["error"] = traceback.format_exc()
        raise
    finally:
        torch.save(results, f"{results_file}.{rank}")
        dist.batch_isend_irecv = counter.original
    dist.destroy_process_group()


_RESULTS: dict[int, list[dict] | str] = {}


def _results(world, tmp_path_factory) -> list[dict]:
    """Every case's results on every rank of a ring of `world` processes (run once per world size; a failed run
    fails every test that reads it, without running again)."""
    if world not in _RESULTS:
        try:
            _RESULTS[world] = _spawn_ring(world, tmp_path_factory)
        except Exception as error:
            _RESULTS[world] = f"the ring of {world} processes failed: {error}"
    if isinstance(_RESULTS[world], str):
        pytest.fail(_RESULTS[world], pytrace=False)
    return _RESULTS[world]


def _spawn_ring(world, tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp(f"ring{world}")
    results_file = folder / "results"
    context = mp.start_processes(_worker, args=(world, str(folder / "rendezvous"), str(results_file)),
                                 nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            raise TimeoutError(f"the ring of {world} processes did not finish within 120 s (a hang)")
    return [torch.load(f"{results_file}.{rank}", weights_only=False) for rank in range(world)]


RING_CASES = [(name, world) for name, (worlds, *_) in CASES.items() for world in worlds]


@pytest.mark.parametrize("name,world", RING_CASES, ids=[f"{n}-w{w}" for n, w in RING_CASES])
def test_ring_matches_single_process_attention(name, world, tmp_path_factory):
    _, layout, causal, *_ = CASES[name]
    per_rank = _results(world, tmp_path_factory)
    _check_against_oracle(name, world, layout, causal, [r[name] for r in per_rank])


def test_ring_still_works_after_refusals(tmp_path_factory):
    per_rank = _results(2, tmp_path_factory)
    _check_against_oracle("full", 2, "contiguous", False, [r["after-refusals"] for r in per_rank])


def _check_against_oracle(name, world, layout, causal, shards):
    unshard = UNSHARD[layout]
    got = {key: unshard([s[key] for s in shards], dim=2 if key == "lse" else 1)
           for key in ("out", "lse", "dq", "dk", "dv")}
    q, k, v, grad_out, grad_lse = _full_inputs(name, world)
    inputs64 = [t.clone().requires_grad_() for t in (q, k, v)]
    options = OPTIONS.get(name, {})
    want_out, want_lse = flash_attn_reference(*inputs64, causal=causal, **options)
    want = _with_gradients(want_out, want_lse, grad_out, grad_lse, inputs64)
    inputs32 = [t.float().requires_grad_() for t in (q, k, v)]
    with flashtile.use_backend("torch"):
        eager_out, eager_lse = flashtile.flash_attn_func(*inputs32, causal=causal, return_lse=True, **options)
    eager = _with_gradients(eager_out, eager_lse, grad_out.float(), grad_lse.float(), inputs32)
    _assert_ring_follows_the_rule(name, world, got, want, eager)


def _with_gradients(out, lse, grad_out, grad_lse, inputs) -> dict:
    """out, lse and dq, dk, dv of the loss sum(out * grad_out) + sum(lse * grad_lse) with respect to inputs."""
    grads = torch.autograd.grad((out * grad_out).sum() + (lse * grad_lse).sum(), inputs)
    return dict(zip(("dq", "dk", "dv"), grads), out=out, lse=lse)


def _assert_ring_follows_the_rule(name, world, got, want, eager) -> None:
    """The ring's float32 out, lse and gradients against the float64 oracle (want), by the eager rule (eager)."""
    for key in ("out", "lse", "dq", "dk", "dv"):
        assert got[key].dtype == torch.float32, f"{key}: dtype {got[key].dtype}"
        assert_close_to_oracle(f"{name}, world {world}: {key}", got[key], want[key].detach(), eager[key].detach(),
                               torch.float32, seed=f"{name}-{world}")


VARLEN_RING_CASES = [(name, world) for name, (worlds, *_) in VARLEN_CASES.items() for world in worlds]


@pytest.mark.parametrize("name,world", VARLEN_RING_CASES, ids=[f"{n}-w{w}" for n, w in VARLEN_RING_CASES])
def test_varlen_ring_matches_single_process_attention(name, world, tmp_path_factory):
    """Against the float64 oracle on each gathered sequence, by the eager rule with flashtile's single-process
    flash_attn_varlen_func on the gathered packed batch."""
    _, layout, causal, *_ = VARLEN_CASES[name]
    shards = [r[name] for r in _results(world, tmp_path_factory)]
    q, k, v, grad_out, grad_lse, cu = _varlen_inputs(name, world)
    got = {key: UNSHARD_VARLEN[layout]([s[key] for s in shards], cu, dim=1 if key == "lse" else 0)
           for key in ("out", "lse", "dq", "dk", "dv")}
    bounds = cu.tolist()
    options = VARLEN_OPTIONS.get(name, {})
    inputs64 = [t.clone().requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:   # an empty sequence has no rows
            sequence_options = dict(options)
            if "alibi_slopes" in options and options["alibi_slopes"].dim() == 2:
                sequence_options["alibi_slopes"] = options["alibi_slopes"][i:i + 1]
            o, l = flash_attn_reference(*(t[a:b].unsqueeze(0) for t in inputs64), causal=causal, **sequence_options)
            outs.append(o[0])
            lses.append(l[0])
    want_out, want_lse = torch.cat(outs), torch.cat(lses, dim=1)
    want = _with_gradients(want_out, want_lse, grad_out, grad_lse, inputs64)
    inputs32 = [t.float().requires_grad_() for t in (q, k, v)]
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    with flashtile.use_backend("torch"):
        eager_out, eager_lse = flashtile.flash_attn_varlen_func(*inputs32, cu, cu, longest, longest, causal=causal,
                                                                return_lse=True, **options)
    eager = _with_gradients(eager_out, eager_lse, grad_out.float(), grad_lse.float(), inputs32)
    _assert_ring_follows_the_rule(name, world, got, want, eager)


def test_ring_over_a_subgroup(tmp_path_factory):
    per_rank = _results(4, tmp_path_factory)
    _check_against_oracle("causal-zigzag", 2, "zigzag", True, [per_rank[1]["subgroup"], per_rank[3]["subgroup"]])


@pytest.mark.parametrize("world", (2, 4))
def test_point_to_point_operations_per_call(world, tmp_path_factory):
    """The forward posts W - 1 batches (K and V out, K and V in: 4 operations each); the backward runs the K/V ring
    again and sends the dK/dV accumulators around it: 2 (W - 1) batches of 4."""
    for rank, results in enumerate(_results(world, tmp_path_factory)):
        for name, (worlds, *_) in (CASES | VARLEN_CASES).items():
            if world not in worlds:
                continue
            assert results[name]["forward_p2p"] == (world - 1, 4 * (world - 1)), \
                f"{name}, rank {rank}: forward (calls, ops) {results[name]['forward_p2p']}"
            assert results[name]["backward_p2p"] == (2 * (world - 1), 8 * (world - 1)), \
                f"{name}, rank {rank}: backward (calls, ops) {results[name]['backward_p2p']}"


@pytest.mark.parametrize("name,expected", [("uneven-seqlen", "same shapes"),
                                           ("q-k-mismatch-on-one-rank", "must share batch and seqlen_local"),
                                           ("zigzag-odd-seqlen", "(odd)")])
def test_bad_shapes_raise_on_every_rank(name, expected, tmp_path_factory):
    for rank, results in enumerate(_results(2, tmp_path_factory)):
        message = results[name]
        assert message.startswith("ValueError") and expected in message, f"rank {rank}: {message}"


@pytest.mark.parametrize("name,expected", [("varlen-cu-seqlens-differ", "must be the same on every rank"),
                                           ("varlen-total-mismatch-on-one-rank", "must share total_local"),
                                           ("varlen-zigzag-odd-length", "odd lengths"),
                                           ("varlen-slopes-of-another-shape", "alibi_slopes")])
def test_bad_varlen_shards_raise_on_every_rank(name, expected, tmp_path_factory):
    for rank, results in enumerate(_results(2, tmp_path_factory)):
        message = results[name]
        assert message.startswith("ValueError") and expected in message, f"rank {rank}: {message}"


@pytest.mark.parametrize("world", (1, 2, 3, 4))
def test_varlen_sharding_round_trips(world):
    cu = torch.tensor([0, 2 * world, 2 * world, 8 * world], dtype=torch.int32)
    x = torch.arange(2 * 8 * world * 3).reshape(2, 8 * world, 3)   # the tokens along dim 1, as an lse
    for layout, shard, unshard in (("contiguous", contiguous_shard_varlen, contiguous_unshard_varlen),
                                   ("zigzag", zigzag_shard_varlen, zigzag_unshard_varlen)):
        shards = [shard(x, cu, r, world, dim=1) for r in range(world)]
        assert torch.equal(unshard(shards, cu, dim=1), x)
        local = shard_cu_seqlens(cu, world, layout).tolist()
        dense = SHARD[layout]
        for r, got in enumerate(shards):
            # each sequence's piece of a shard is the dense helper's shard of that sequence
            for i, (a, b) in enumerate(zip(local, local[1:])):
                whole = x[:, cu[i]:cu[i + 1]]
                assert torch.equal(got[:, a:b], dense(whole, r, world) if b > a else whole), (layout, r, i)
    bad = torch.tensor([0, 2 * world + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of"):
        shard_cu_seqlens(bad, world, "zigzag")
    with pytest.raises(ValueError, match="multiple of"):
        zigzag_shard_varlen(torch.zeros(2 * world + 1, 3), bad, 0, world)
    with pytest.raises(ValueError, match="rows along dim"):
        contiguous_shard_varlen(x, cu, 0, world)   # dim 0 has 2 rows, not 8 * world


@pytest.mark.parametrize("world", (1, 2, 3, 4))
def test_sharding_round_trips(world):
    x = torch.arange(2 * 2 * world * 3 * 2).reshape(2, 2 * world * 3, 2)
    assert torch.equal(contiguous_unshard([contiguous_shard(x, r, world) for r in range(world)]), x)
    assert torch.equal(zigzag_unshard([zigzag_shard(x, r, world) for r in range(world)]), x)
    chunks = x.chunk(2 * world, dim=1)
    for r in range(world):
        assert torch.equal(zigzag_shard(x, r, world), torch.cat([chunks[r], chunks[2 * world - 1 - r]], dim=1))
    with pytest.raises(ValueError, match="does not split"):
        zigzag_shard(x[:, :-1], 0, world)
    with pytest.raises(ValueError, match="rank"):
        contiguous_shard(x, world, world)


def test_unsupported_arguments_are_refused_before_communicating():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="layout"):
        ring_flash_attn_func(q, q, q, layout="striped")
    # flash_attn_func's own rules on the window and the slopes, on the local shards
    with pytest.raises(ValueError, match="window_size"):
        ring_flash_attn_func(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match="alibi_slopes"):
        ring_flash_attn_func(q, q, q, alibi_slopes=torch.ones(3))
    packed, cu = torch.randn(4, 2, 16), torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="layout"):
        ring_flash_attn_varlen_func(packed, packed, packed, cu, 4, layout="striped")
    # flash_attn_varlen_func's own rules on the window, before the collective checks (the slopes' shape, which
    # depends on the sequences, after them: test_bad_varlen_shards_raise_on_every_rank)
    with pytest.raises(ValueError, match="window_size"):
        ring_flash_attn_varlen_func(packed, packed, packed, cu, 4, window_size=(-2, 0))
    with pytest.raises(TypeError, match="max_seqlen"):
        ring_flash_attn_varlen_func(packed, packed, packed, cu, 4.0)


def test_benchmark_script_on_one_cpu_rank_communicates_nothing(tmp_path, monkeypatch):
    """benchmarks/ring_attention.py's main at tiny sizes on a 1-process gloo group: every cell checks the ring against
    plain attention and is timed, and the ring of one rank posts no point-to-point operation and gathers nothing
    (its only collectives are the script's own all_reduce of the timings and errors)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ring_attention.py"
    spec = importlib.util.spec_from_file_location("ring_attention_benchmark", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    def refuse(*args, **kwargs):
        raise AssertionError("a ring of one rank communicated")
    monkeypatch.setattr(dist, "batch_isend_irecv", refuse)
    monkeypatch.setattr(dist, "all_gather", refuse)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        with flashtile.use_backend("torch"):
            records = script.main(["--device", "cpu", "--seqlens", "8", "--heads", "2", "--kv-heads", "1",
                                   "--headdim", "16", "--warmup", "1", "--reps", "1"])
    finally:
        dist.destroy_process_group()
    cells = {(r["causal"], r["layout"], r["mode"]) for r in records}
    assert cells == {(c, layout, mode) for c in (False, True) for layout in ("contiguous", "zigzag")
                     for mode in ("fwd", "fwd_bwd")}
    for record in records:
        assert record["world"] == 1 and record["max_abs_err"] <= 1e-4 and record["ring_ms"] > 0, record
