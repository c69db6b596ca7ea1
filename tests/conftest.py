"""Shared fixtures and oracle helpers.

The oracle is `flashtile.reference` in float64. Low-precision results follow the rule used by
flash-attn and FlexAttention: the error of flashtile against float64 must be at most twice the
error of the same dense formula evaluated eagerly in the input dtype, plus a rounding floor.

Random inputs come from a seed fixed per test (derived from the test's id, so a test draws the same
inputs on every machine, alone or in any order and any number of workers); the seed is in failure
messages and in the report of any failing test. Nothing depends on the host's BLAS: under Triton's
interpreter a dot is a NumPy matmul whose rounding depends on the BLAS kernel the CPU selects and on
the operands' memory layout, so two schedules are compared within the eager rule's bound, never bit
for bit (only repeated runs of one schedule are).
"""

from __future__ import annotations

import collections
import contextlib
import os
import zlib

# FLASHTILE_TEST_DEVICE=cuda runs the suite on the GPU; otherwise the Triton kernels run on CPU
# tensors through Triton's interpreter, which must be switched on before anything imports triton
# (torch may), because triton.jit reads it when a function is decorated.
_DEVICE_NAME = os.environ.get("FLASHTILE_TEST_DEVICE", "cpu")
if _DEVICE_NAME == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import flashtile  # noqa: E402

# Tests pick backends and schedules explicitly; a developer's FLASHTILE_BACKEND / FLASHTILE_SCHEDULE must not leak
# into them.
os.environ.pop("FLASHTILE_BACKEND", None)
os.environ.pop("FLASHTILE_SCHEDULE", None)

DEVICE = torch.device(_DEVICE_NAME)
INTERPRETED = DEVICE.type == "cpu"

LOW_PRECISION = (torch.float16, torch.bfloat16)
BACKENDS = ("torch", "triton")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def skip_unsupported(backend: str, dtype: torch.dtype) -> None:
    """Skip the combinations a backend documents as unsupported (never a failing case)."""
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernels do not take float64 (documented; the torch backend serves it)")
    if backend == "triton" and dtype == torch.bfloat16 and INTERPRETED:
        pytest.skip("Triton's CPU interpreter computes bf16 dots wrongly (upstream bug); bf16 runs on the GPU suite")


def forced_tiles(backend: str, rows: int, cols: int) -> contextlib.AbstractContextManager:
    """Run on `backend` with tiles of about rows x cols (Triton tiles: powers of two >= 16)."""
    if backend == "torch":
        return flashtile.use_backend("torch", block_q=rows, block_k=cols)
    def p2(n):
        return max(16, 1 << (n - 1).bit_length())
    return flashtile.use_backend("triton", block_m=p2(rows), block_n=p2(cols), bwd_block_m=p2(rows),
                                 bwd_block_n=p2(cols))


def seed_of(nodeid: str) -> int:
    """The seed of a test: a function of its id alone (not of the machine, the order or the worker)."""
    return zlib.crc32(nodeid.encode()) & 0x7FFFFFFF


@pytest.fixture(autouse=True)
def _seeded_rng(request) -> int:
    """Every test starts from torch's generator seeded with its own seed."""
    value = seed_of(request.node.nodeid)
    torch.manual_seed(value)
    return value


@pytest.fixture
def seed(_seeded_rng) -> int:
    """This test's seed (already seeded into torch), for failure messages."""
    return _seeded_rng


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("flashtile", f"torch seed of this test: {seed_of(item.nodeid)}"))


def random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v, dtype, requires_grad=False,
               scale=1.0):
    """Random q, k, v in flash-attn layout (batch, seqlen, heads, dim), on the test device."""
    def make(*shape):
        x = torch.randn(*shape, dtype=torch.float64) * scale
        return x.to(device=DEVICE, dtype=dtype).requires_grad_(requires_grad)

    return (make(batch, seqlen_q, nheads, headdim), make(batch, seqlen_k, nheads_k, headdim),
            make(batch, seqlen_k, nheads_k, headdim_v))


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """Largest |actual - expected| and where; positions where both are -inf count as equal."""
    a, e = actual.double(), expected.double()
    both_neg_inf = (a == float("-inf")) & (e == float("-inf"))
    diff = (a - e).abs().masked_fill(both_neg_inf, 0.0)
    if diff.numel() == 0:
        return 0.0, ()
    flat = int(diff.reshape(-1).nan_to_num(nan=float("inf")).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    value = diff.reshape(-1)[flat].item()
    return (float("inf") if value != value else value), index


def rounding_floor(dtype: torch.dtype, expected: torch.Tensor) -> float:
    """A few units in the last place of the largest finite expected value.

    fp16/bf16 results are computed in fp32 and rounded once, so 2 ulp suffice there; for fp32 the
    kernel and the eager baseline round at the same precision in different orders, so their errors
    are comparable random walks and the floor allows for reductions over a few hundred terms.
    """
    finite = expected[expected.isfinite()]
    magnitude = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    ulps = 32 if dtype == torch.float32 else 2
    return ulps * torch.finfo(dtype).eps * magnitude


def eager_rule_bound(oracle, eager, dtype, floor=None) -> float:
    """How far flashtile may be from the float64 oracle: 2 x the same-dtype eager error + a rounding floor."""
    floor = rounding_floor(dtype, oracle) if floor is None else floor
    return 2 * max_abs_error(eager, oracle)[0] + floor


def assert_close_to_oracle(what: str, actual, oracle, eager, dtype, seed, floor=None):
    """flashtile's error vs float64 <= 2 x the same-dtype eager error + a rounding floor."""
    assert actual.shape == oracle.shape, f"{what}: shape {tuple(actual.shape)} != oracle {tuple(oracle.shape)}"
    assert not actual.isnan().any(), f"{what}: NaN in flashtile's result (seed {seed})"
    error, where = max_abs_error(actual, oracle)
    eager_error, _ = max_abs_error(eager, oracle)
    floor = rounding_floor(dtype, oracle) if floor is None else floor
    assert error <= 2 * eager_error + floor, (f"{what}: max error {error:.3e} at {where} exceeds 2 x eager "
                                              f"{eager_error:.3e} + floor {floor:.1e} ({dtype}, seed {seed})")


def assert_within_bounds(names, first, second, bounds: dict, what: str, seed) -> None:
    """Two results of one function (two schedules, say): each named tensor within bounds[name] of the other (the
    eager rule's bound, eager_rule_bound, which each also keeps to against the oracle)."""
    for name, a, b in zip(names, first, second):
        assert a.shape == b.shape, f"{name}: shapes {tuple(a.shape)} and {tuple(b.shape)} ({what})"
        error, where = max_abs_error(a, b)
        assert error <= bounds[name], (f"{name} differs between {what} by {error:.3e} at {where}, over the eager "
                                       f"rule's {bounds[name]:.3e} (seed {seed})")


def assert_exact_to_oracle(what: str, actual, oracle, seed, tol=1e-10):
    """For float64 inputs: flashtile must agree with the oracle to near machine precision."""
    assert actual.shape == oracle.shape, f"{what}: shape {tuple(actual.shape)} != oracle {tuple(oracle.shape)}"
    error, where = max_abs_error(actual, oracle)
    assert error <= tol, f"{what}: max error {error:.3e} at {where} exceeds {tol:.0e} (float64, seed {seed})"


def attention_grads(out, lse, inputs, grad_out, grad_lse):
    """Gradients of <out, grad_out> + <lse, grad_lse> (a float64 loss; rows that see no key have lse = -inf
    and are left out of the lse term); inputs that no gradient reaches get zeros."""
    lse = torch.where(lse.isfinite(), lse, torch.zeros_like(lse))
    loss = (out.double() * grad_out).sum() + (lse.double() * grad_lse).sum()
    return torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)


def assert_attention_follows_the_eager_rule(got, want, eager, inputs, dtype, seed, names=("dq", "dk", "dv")):
    """got / want / eager: (out, lse) from flashtile, the float64 oracle and the same formula evaluated
    eagerly in `dtype`. Checks out and lse, then the gradients of `inputs` (named by `names`: dq, dk, dv for
    q, k, v) through both (random cotangents), each within 2x the eager error + the rounding floor, and the
    dtypes flashtile returns (each gradient in its input's dtype). Returns flashtile's gradients, the cotangents
    (grad_out, grad_lse) they were taken with and the eager rule's bound of each of out, lse and the named
    gradients (eager_rule_bound), for callers that compare another run."""
    (out, lse), (ref_out, ref_lse), (eager_out, eager_lse) = got, want, eager
    assert out.dtype == dtype and lse.dtype == torch.float32, f"out {out.dtype}, lse {lse.dtype}"
    lse_dtype = torch.float32 if dtype == torch.float32 else dtype
    assert_close_to_oracle("out", out, ref_out, eager_out, dtype, seed)
    assert_close_to_oracle("lse", lse, ref_lse, eager_lse, lse_dtype, seed)
    bounds = {"out": eager_rule_bound(ref_out, eager_out, dtype),
              "lse": eager_rule_bound(ref_lse, eager_lse, lse_dtype)}
    grad_out, grad_lse = torch.randn_like(ref_out), torch.randn_like(ref_lse)
    grads = [attention_grads(o, l, inputs, grad_out, grad_lse) for o, l in (got, want, eager)]
    for name, t, g, w, e in zip(names, inputs, *grads):
        assert g.dtype == t.dtype, f"{name} has dtype {g.dtype}, expected {t.dtype}"
        assert_close_to_oracle(name, g, w, e, dtype, seed)
        bounds[name] = eager_rule_bound(w, e, dtype)
    return grads[0], (grad_out, grad_lse), bounds


# The files whose module set-up compiles kernels for sm_90 (the two Gluon compiles, one per Triton, are files of their
# own so that two workers share them), and the largest parametrisations: collected first, so that pytest-xdist (--dist
# loadfile hands whole files to the workers in the order of its queue) starts them first and the run does not end with
# one worker on a long file while the other idles.
LONG_FILES = ("test_gluon_compile.py", "test_gluon_compile_gpu_triton.py", "test_triton_compile.py", "test_kvcache.py",
              "test_flash_attn.py", "test_varlen.py", "test_triton_schedules.py")


def pytest_configure(config):
    # xdist's --dist loadfile queues files by their number of tests, largest first, unless told to keep the
    # collection's order: the compile files hold a few tests each and would start last
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    # after the long files, the others by their number of tests, largest first (xdist's own guess at their length)
    tests_in = collections.Counter(item.path.name for item in items)

    def rank(item):
        name = item.path.name
        return (LONG_FILES.index(name), 0) if name in LONG_FILES else (len(LONG_FILES), -tests_in[name])
    items.sort(key=rank)  # stable: the order within each file is kept
