"""Train a small character-level GPT whose attention is flashtile.flash_attn_func or PyTorch's SDPA.

The model is a decoder-only transformer (pre-LayerNorm blocks, learned positions) trained
to predict the next character of Jane Austen's *Pride and Prejudice* (examples/data/pride_and_prejudice.txt,
the Project Gutenberg eBook #1342 with its licence, which allows redistribution; only the text between
the Gutenberg start and end markers is trained on). The attention of every block is one causal call to

    --attn flashtile   flashtile.flash_attn_func(q, k, v, causal=True)      q, k, v: (batch, seq, heads, dim)
    --attn sdpa        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                                                                           q, k, v: (batch, heads, seq, dim)

and the rest of the model code is shared. With `--attn both` the two train one after the other from the same
seed, so they start from the same weights and see the same batches: their step-0 losses agree up to float
rounding (the script checks this on the first batch before training and prints the difference), and their
loss curves should lie on top of each other. The script prints each attention's training throughput (tokens/s,
counting the steps after the first, which includes the kernels' compilation, and leaving out evaluation), the
final train and validation losses (averages over fixed batches), and a short greedy sample; it writes both loss
curves on one plot (--plot) and, with --json, every number.

Usage (from the repository root, after `pip install -e ".[examples]"`, which adds tqdm and matplotlib):

    # CPU: a tiny model (0.1M parameters), about a minute on two cores for both attentions
    python examples/train_gpt.py --device cpu --size small --attn both --threads 1

    # GPU: 6 layers, width 384, 6 heads of 64, context 256, dropout 0.2, bf16 autocast (10.8M parameters)
    python examples/train_gpt.py --device cuda --size gpu --attn both --steps 2000 --json out/train_gpt.json

On CUDA, flashtile runs its Triton kernels; on CPU tensors it runs its pure-PyTorch tiled backend (what each call
runs is printed, from flashtile.explain). `--n-layer`, `--n-embd`, `--n-head`, `--block-size`,
`--batch-size`, `--lr` and `--dropout` override the preset's values.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import flashtile

EXAMPLES_DIR = Path(__file__).resolve().parent
DEFAULT_DATA = EXAMPLES_DIR / "data" / "pride_and_prejudice.txt"
DEFAULT_PLOT = EXAMPLES_DIR / "train_gpt_loss.png"
ATTENTIONS = ("flashtile", "sdpa")
SAMPLE_PROMPT = "It is a truth"
GUTENBERG_START, GUTENBERG_END = "*** START OF THE PROJECT GUTENBERG EBOOK", "*** END OF THE PROJECT GUTENBERG EBOOK"
MISSING_EXTRA = ("examples/train_gpt.py needs {package} ({purpose}). Install the examples' extra: "
                 "pip install -e \".[examples]\" (or pip install {package})")


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model shape and a training schedule."""

    n_layer: int
    n_embd: int
    n_head: int
    block_size: int  # context length (characters)
    batch_size: int
    steps: int
    lr: float
    dropout: float  # on the embeddings and each residual branch (none in attention: both attentions run without it)
    eval_every: int  # steps between evaluations (and the last step)
    eval_batches: int  # batches averaged per split and evaluation
    sample_chars: int


PRESETS = {
    "small": Preset(n_layer=2, n_embd=64, n_head=4, block_size=64, batch_size=16, steps=600, lr=6e-3,
                    dropout=0.0, eval_every=50, eval_batches=8, sample_chars=80),
    "gpu": Preset(n_layer=6, n_embd=384, n_head=6, block_size=256, batch_size=64, steps=2000, lr=1e-3,
                  dropout=0.2, eval_every=250, eval_batches=40, sample_chars=300),
}


def require(module: str, purpose: str):
    """Import an optional dependency of this example, or exit with a message naming the extra that provides it."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise SystemExit(MISSING_EXTRA.format(package=module.split(".")[0], purpose=purpose)) from None


# --- data ---------------------------------------------------------------------------------------------------------

def load_text(path: Path) -> str:
    """The text of `path`; of a Project Gutenberg file, only the book between its start and end markers."""
    text = path.read_text(encoding="utf-8-sig")
    start, end = text.find(GUTENBERG_START), text.find(GUTENBERG_END)
    if start != -1 and end > start:
        text = text[text.index("\n", start) + 1:end]
    return text


class CharData:
    """Characters as token ids, split 90% / 10% into train and validation, with seeded batch sampling."""

    def __init__(self, text: str, block_size: int):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.index[c] for c in text], dtype=torch.long)
        cut = int(0.9 * len(ids))
        self.splits = {"train": ids[:cut], "val": ids[cut:]}
        self.block_size = block_size
        for name, split in self.splits.items():
            if len(split) <= block_size:
                raise ValueError(f"the {name} split has {len(split)} characters, fewer than block_size + 1 = "
                                 f"{block_size + 1}; use a longer text or a smaller --block-size")

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (batch_size, block_size) on the CPU; y is x shifted by one character."""
        data = self.splits[split]
        starts = torch.randint(len(data) - self.block_size, (batch_size,), generator=generator)
        offsets = torch.arange(self.block_size + 1)
        chunks = data[starts[:, None] + offsets]
        return chunks[:, :-1], chunks[:, 1:]


# --- model --------------------------------------------------------------------------------------------------------

def flashtile_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k, v, out: (batch, seq, heads, head_dim), flash-attn's layout."""
    return flashtile.flash_attn_func(q, k, v, causal=True)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same contract through torch's SDPA, which takes (batch, heads, seq, head_dim)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


ATTENTION_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {"flashtile": flashtile_attention,
                                                               "sdpa": sdpa_attention}


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.attention = flashtile_attention  # set by GPT.use_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_head, width // self.n_head).unbind(2)
        # q, k, v are already in autocast's dtype: both attentions compute in it
        out = self.attention(q, k, v)
        return self.dropout(self.proj(out.reshape(batch, seq, width)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=False), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer over characters."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's initialisation; residual projections scaled down by depth
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def use_attention(self, name: str) -> None:
        for block in self.blocks:
            block.attn.attention = ATTENTION_FUNCTIONS[name]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (batch, seq) token ids, seq <= block_size. Returns logits (batch, seq, vocab_size)."""
        x = self.dropout(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_of(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def generate_greedy(model: GPT, data: CharData, prompt: str, n_chars: int, device: torch.device, autocast) -> str:
    """Greedy continuation of `prompt`. Every step runs one window of block_size tokens (the tail of the text,
    padded on the right): under causal attention the logits at a position ignore what comes after it, and one
    shape for every call means the GPU kernels are compiled once."""
    model.eval()  # no dropout
    ids = [data.index[c] for c in prompt if c in data.index] or [0]
    window = torch.zeros(1, model.block_size, dtype=torch.long, device=device)
    for _ in range(n_chars):
        context = ids[-model.block_size:]
        window[0, :len(context)] = torch.tensor(context, device=device)
        with autocast():
            logits = model(window)[0, len(context) - 1]
        ids.append(int(logits.argmax()))
    return data.decode(ids)


# --- training -----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Config:
    attn: str
    device: str
    size: str
    steps: int
    seed: int
    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    batch_size: int
    lr: float
    dropout: float
    eval_every: int
    eval_batches: int
    sample_chars: int
    precision: str  # "fp32" or "bf16" (autocast)
    data: str


def autocast_for(config: Config):
    if config.precision == "bf16":
        return lambda: torch.autocast(device_type=torch.device(config.device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def build_model(config: Config, vocab_size: int) -> GPT:
    torch.manual_seed(config.seed)  # the same initial weights for every attention
    return GPT(vocab_size, config.block_size, config.n_layer, config.n_embd, config.n_head,
               config.dropout).to(config.device)


def learning_rate(config: Config, step: int) -> float:
    """Linear warm-up over the first 5% of the steps, then cosine decay to a tenth."""
    warmup = max(1, config.steps // 20)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def make_optimizer(config: Config, model: GPT) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.99), fused=config.device.startswith("cuda"))


def fixed_batches(config: Config, data: CharData, split: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The evaluation batches of a split: drawn once from a seed of their own, the same for every attention."""
    generator = torch.Generator().manual_seed(config.seed + (1 if split == "train" else 2))
    return [tuple(t.to(config.device) for t in data.batch(split, config.batch_size, generator))
            for _ in range(config.eval_batches)]


@torch.no_grad()
def evaluate(model: GPT, batches: dict[str, list], autocast) -> dict[str, float]:
    model.eval()
    with autocast():
        means = {split: torch.stack([loss_of(model, x, y) for x, y in split_batches]).mean()
                 for split, split_batches in batches.items()}
    model.train()
    return {split: float(mean) for split, mean in means.items()}


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def step0_check(config: Config, data: CharData) -> dict[str, Any]:
    """The freshly initialised model's logits on the first training batch, through each attention (no dropout)."""
    model = build_model(config, data.vocab_size).eval()
    x, y = (t.to(config.device) for t in data.batch("train", config.batch_size,
                                                    torch.Generator().manual_seed(config.seed)))
    autocast, results = autocast_for(config), {}
    with torch.no_grad(), autocast():
        for name in ATTENTIONS:
            model.use_attention(name)
            logits = model(x).float()
            results[name] = (logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1)))
    tolerance = 1e-4 if config.precision == "fp32" else 3e-2
    loss_difference = abs(float(results["flashtile"][1]) - float(results["sdpa"][1]))
    return {"max_abs_logit_difference": float((results["flashtile"][0] - results["sdpa"][0]).abs().max()),
            "loss_flashtile": float(results["flashtile"][1]), "loss_sdpa": float(results["sdpa"][1]),
            "loss_difference": loss_difference, "tolerance": tolerance, "agree": loss_difference <= tolerance}


def train(config: Config, data: CharData, attn: str, tqdm) -> dict[str, Any]:
    """Train one model from the seed's initial weights with `attn`; returns its curves and numbers."""
    model = build_model(config, data.vocab_size)
    model.use_attention(attn)
    optimizer = make_optimizer(config, model)
    autocast = autocast_for(config)
    generator = torch.Generator().manual_seed(config.seed)  # the same batches for every attention
    eval_sets = {split: fixed_batches(config, data, split) for split in ("train", "val")}
    tokens_per_step = config.batch_size * config.block_size

    step_losses, evals = [], []
    # throughput: the steps after the first (which compiles the GPU kernels), timed in segments between evaluations
    # (synchronising only at their ends, so the GPU's queue of work is not drained every step)
    first_timed = 1 if config.steps > 1 else 0
    timed_seconds, timed_steps, segment_start = 0.0, 0, None
    wall_start = time.perf_counter()
    bar = tqdm(range(config.steps), desc=f"{attn:>9}", unit="step", dynamic_ncols=True)
    for step in bar:
        if step % config.eval_every == 0:
            if segment_start is not None:
                synchronize(config.device)
                timed_seconds += time.perf_counter() - segment_start
                segment_start = None
            evals.append({"step": step, **evaluate(model, eval_sets, autocast)})
            bar.set_postfix(val=f"{evals[-1]['val']:.3f}")
        if step >= first_timed:
            if segment_start is None:
                synchronize(config.device)
                segment_start = time.perf_counter()
            timed_steps += 1
        x, y = (t.to(config.device, non_blocking=True) for t in data.batch("train", config.batch_size, generator))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        with autocast():
            loss = loss_of(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step_losses.append(loss.detach())
        if step % 10 == 0 or step == config.steps - 1:
            bar.set_postfix(loss=f"{float(step_losses[-1]):.3f}", val=f"{evals[-1]['val']:.3f}")
    synchronize(config.device)
    timed_seconds += time.perf_counter() - segment_start
    bar.close()
    final = evaluate(model, eval_sets, autocast)
    evals.append({"step": config.steps, **final})
    sample = generate_greedy(model, data, SAMPLE_PROMPT, config.sample_chars, torch.device(config.device), autocast)
    wall_seconds = time.perf_counter() - wall_start

    q = torch.zeros(config.batch_size, config.block_size, config.n_head, config.n_embd // config.n_head,
                    device=config.device, dtype=torch.bfloat16 if config.precision == "bf16" else torch.float32)
    return {
        "attn": attn,
        "step_losses": [float(v) for v in torch.stack(step_losses).cpu()],
        "evals": evals,
        "final_train_loss": final["train"],
        "final_val_loss": final["val"],
        "tokens_per_s": timed_steps * tokens_per_step / timed_seconds,
        "timed_steps": timed_steps,
        "wall_seconds": wall_seconds,
        "sample": sample,
        "kernel": (str(flashtile.explain(q, q, q, causal=True)).splitlines()[0] if attn == "flashtile"
                   else "torch.nn.functional.scaled_dot_product_attention"),
    }


def plot_losses(path: Path, config: Config, runs: list[dict[str, Any]], pyplot) -> None:
    figure, axes = pyplot.subplots(figsize=(8, 5))
    styles = {"flashtile": ("tab:blue", "-"), "sdpa": ("tab:orange", "--")}
    for run in runs:
        color, line = styles[run["attn"]]
        label = f"{run['attn']} ({run['tokens_per_s']:,.0f} tokens/s)"
        axes.plot(range(len(run["step_losses"])), run["step_losses"], color=color, linestyle=line, linewidth=1,
                  alpha=0.8, label=f"{label}: train (batch)")
        axes.plot([e["step"] for e in run["evals"]], [e["val"] for e in run["evals"]], color=color, linestyle=line,
                  marker="o", markersize=4, label=f"{label}: validation")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats per character)")
    axes.set_title(f"char-level GPT: {config.n_layer} layers, width {config.n_embd}, {config.n_head} heads, "
                   f"context {config.block_size}, {config.precision} on {config.device}")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


def parse_args(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attn", choices=ATTENTIONS + ("both",), default="both",
                        help="attention implementation; both: flashtile then sdpa, same seed, weights and batches")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--size", choices=sorted(PRESETS), default=None,
                        help="model and schedule preset (default: gpu on cuda, small on cpu)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                        help="bf16 autocast or plain fp32 (default: bf16 on cuda, fp32 on cpu)")
    for name in ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "eval_every", "eval_batches",
                 "sample_chars"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="override the preset's")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    parser.add_argument("--dropout", type=float, default=None, help="dropout probability (default: the preset's)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="a UTF-8 text file (default: %(default)s)")
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help="PNG of the loss curves (%(default)s)")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers to this JSON file")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of torch's operators (default: torch's); 1 is fastest for the small "
                             "preset on a machine whose cores are busy with other work")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be positive, got {args.threads}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    preset = PRESETS[args.size or ("gpu" if device.type == "cuda" else "small")]
    values = {f.name: getattr(args, f.name) if getattr(args, f.name, None) is not None else getattr(preset, f.name)
              for f in dataclasses.fields(Preset)}
    for name, value in values.items():
        if name == "dropout" and not 0.0 <= value < 1.0:
            parser.error(f"--dropout must be in [0, 1), got {value}")
        if name not in ("lr", "dropout") and value < (0 if name == "sample_chars" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    config = Config(attn=args.attn, device=str(device), size=args.size or ("gpu" if device.type == "cuda" else "small"),
                    seed=args.seed, precision=args.precision or ("bf16" if device.type == "cuda" else "fp32"),
                    data=str(args.data), **values)
    return config, args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the example with command-line arguments `argv` (None: sys.argv); returns what --json writes."""
    tqdm = require("tqdm.auto", "its progress bar").tqdm
    config, args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        return run_example(config, args, tqdm)
    finally:
        torch.set_num_threads(threads)  # a caller's setting (main runs inside tests) is left as it was


def run_example(config: Config, args: argparse.Namespace, tqdm) -> dict[str, Any]:
    started = time.perf_counter()
    require("matplotlib", "the loss plot").use("Agg")  # files only, no display
    pyplot = require("matplotlib.pyplot", "the loss plot")

    data = CharData(load_text(args.data), config.block_size)
    model = build_model(config, data.vocab_size)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    print(f"data: {args.data.name}, {sum(len(s) for s in data.splits.values()):,} characters, vocabulary "
          f"{data.vocab_size}; model: {n_params / 1e6:.2f}M parameters ({config.n_layer} layers, width "
          f"{config.n_embd}, {config.n_head} heads, context {config.block_size}); batch {config.batch_size}, "
          f"{config.steps} steps, {config.precision} on {config.device}, seed {config.seed}")

    check = step0_check(config, data)
    print(f"step-0 check (same weights, first batch): loss flashtile {check['loss_flashtile']:.6f}, sdpa "
          f"{check['loss_sdpa']:.6f}, difference {check['loss_difference']:.2e} (tolerance {check['tolerance']:.0e}), "
          f"max |logit difference| {check['max_abs_logit_difference']:.2e}: "
          + ("agree" if check["agree"] else "DISAGREE"))

    runs = []
    for attn in ATTENTIONS if config.attn == "both" else (config.attn,):
        record = train(config, data, attn, tqdm)
        runs.append(record)
        print(f"{attn:>9}: {record['tokens_per_s']:,.0f} tokens/s, final train loss {record['final_train_loss']:.4f}, "
              f"val loss {record['final_val_loss']:.4f}, {record['wall_seconds']:.1f} s ({record['kernel']})")
        print(f"{'':>9}  greedy sample: {record['sample']!r}")
    if len(runs) == 2:
        first, second = runs[0]["step_losses"], runs[1]["step_losses"]
        print(f"first-step training loss: flashtile {first[0]:.6f}, sdpa {second[0]:.6f} (difference "
              f"{abs(first[0] - second[0]):.2e}); largest difference over all steps "
              f"{max(abs(a - b) for a, b in zip(first, second)):.2e}")

    result = {"config": dataclasses.asdict(config), "threads": torch.get_num_threads(), "parameters": n_params,
              "vocab_size": data.vocab_size, "torch": torch.__version__, "flashtile": flashtile.__version__,
              "step0_check": check, "runs": runs}
    plot_losses(args.plot, config, runs, pyplot)
    print(f"loss curves: {args.plot}")
    result["wall_seconds"] = time.perf_counter() - started
    print(f"wall time: {result['wall_seconds']:.1f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"numbers: {args.json}")
    return result


if __name__ == "__main__":
    main()
