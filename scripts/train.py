#!/usr/bin/env python
"""A small real trainer for ``fp8_comm_hook``, launched with torchrun; ``--grad-comm fp8`` turns FP8
gradient communication on.

    torchrun --nproc-per-node 2 scripts/train.py --task digits --grad-comm fp8
    torchrun --nproc-per-node 2 scripts/train.py --task charlm --grad-comm bf16 --log-json run.json

Tasks:
  digits  an MLP on scikit-learn's bundled ``load_digits`` (8x8 images, 10 classes), a fixed
          80/20 train/held-out split (the same for every seed), features standardized with the
          training set's statistics.
  charlm  a small GPT-style causal transformer over bytes, trained on the Python standard library's
          own source: the ``*.py`` files in ``sysconfig.get_paths()["stdlib"]`` of the running
          interpreter, in sorted order, up to ``--corpus-bytes``; every 10th file goes to the held-out
          set. ``--corpus-files top`` (default) reads the files directly in that directory;
          ``tree`` reads its packages too (sorted by relative path), without site-packages and the
          test packages, which some distributions ship separately. The corpus differs between
          Python versions: compare runs only within one Python version (the summary records the
          version and the corpus's sha256).

Gloo on CPU, NCCL when CUDA is available (``--backend``/``--device`` override). Every rank draws a
different shard of each epoch's seeded permutation (DistributedSampler-like); evaluation splits the
held-out set over the ranks and sums loss and hits with one all-reduce, so every rank gets the
numbers for the full set. A run is deterministic for a given seed and world size (CPU; on CUDA as
far as the kernels are).

``--log-json PATH`` writes every step (step, loss averaged over ranks, lr), every evaluation and a
final summary (final_eval_loss, final_accuracy (null for charlm), bytes_sent, bytes_baseline,
grad_comm, the FP8 config, world_size, seed, steps, ...). Bytes: for ``fp8`` the hook's own counters;
for ``none``/``bf16`` the ring formula 2(W-1)/W * bytes in the dtype sent (reduce-scatter,
(W-1)/W * bytes, under FSDP). The baseline is always the fp32 ring all-reduce (or reduce-scatter).
"""
import argparse
import gc
import hashlib
import json
import logging
import math
import os
import socket
import sys
import sysconfig
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

try:
    import fp8_comm_hook
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import fp8_comm_hook
from fp8_comm_hook import FP8CommConfig
from fp8_comm_hook.integrations.cli import add_cli_args, config_from_args, grad_comm_from_args, register_grad_comm
from fp8_comm_hook.registry import grad_comm_wire_dtype
from fp8_comm_hook.stats import ring_bytes

log = logging.getLogger("train")

TASK_DEFAULTS = {
    "digits": dict(steps=300, batch_size=32, lr=3e-3, eval_every=50),
    "charlm": dict(steps=300, batch_size=16, lr=2e-3, eval_every=50),
}
SPLIT_SEED = 20240607       # the digits train/held-out split: fixed, independent of --seed
DIGITS_HELD_OUT = 0.2
EVAL_FILE_EVERY = 10        # charlm: every 10th corpus file is held out
EVAL_BATCH = 64
CORPUS_FILES = ("top", "tree")
#: directories ``--corpus-files tree`` skips: installed packages, bytecode, and the test suites that
#: some distributions split into a separate package (so the corpus would depend on what is installed)
CORPUS_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


# ---------------------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    """The trainer's argument parser (task, optimisation, parallelism, logging, FP8 flags)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(TASK_DEFAULTS), default="digits")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default: digits %(d)d, charlm %(c)d)" % {
                       "d": TASK_DEFAULTS["digits"]["steps"], "c": TASK_DEFAULTS["charlm"]["steps"]})
    p.add_argument("--seed", type=int, default=0, help="model init and data order (default 0)")
    p.add_argument("--init-perturbation", type=float, default=0.0, metavar="REL",
                   help="multiply every initial weight by 1 + REL*z, z ~ N(0, 1) drawn with "
                        "--init-perturbation-seed: a run of the same seed that starts a hair away, to measure how "
                        "far training's own chaos carries two runs apart (default 0: off)")
    p.add_argument("--init-perturbation-seed", type=int, default=1,
                   help="seed of the perturbation's z (default 1); the data order and init stay --seed's")
    p.add_argument("--grad-perturbation", type=float, default=0.0, metavar="REL",
                   help="after every step's gradient communication, multiply each gradient by 1 + REL*z, z ~ N(0, 1) "
                        "drawn alike on every rank from --grad-perturbation-seed: about what a reduction in another "
                        "order does to an fp32 all-reduce at 1e-6 (--dp ddp only; default 0: off)")
    p.add_argument("--grad-perturbation-seed", type=int, default=1,
                   help="seed of the gradient perturbation (default 1)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="examples (digits) or sequences (charlm) per rank per step (default: digits %d, charlm %d)"
                        % (TASK_DEFAULTS["digits"]["batch_size"], TASK_DEFAULTS["charlm"]["batch_size"]))
    p.add_argument("--lr", type=float, default=None,
                   help="peak AdamW learning rate (default: digits %g, charlm %g); linear warm-up, cosine to --lr-min-ratio"
                        % (TASK_DEFAULTS["digits"]["lr"], TASK_DEFAULTS["charlm"]["lr"]))
    p.add_argument("--lr-warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    p.add_argument("--lr-min-ratio", type=float, default=0.1,
                   help="the cosine decay ends at this fraction of --lr, in [0, 1] (default 0.1)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm; 0 disables (default 1.0)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default 50)")
    p.add_argument("--dp", choices=("ddp", "fsdp1", "fsdp2"), default="ddp",
                   help="data parallelism; fsdp1/fsdp2 need fp8_comm_hook.register_fsdp_hook")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="process group backend (auto: nccl with CUDA, else gloo)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when available")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size in MB (default 25)")
    p.add_argument("--log-json", metavar="PATH", default=None, help="write steps, evals and a summary here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    d = p.add_argument_group("digits")
    d.add_argument("--hidden", type=int, default=256, help="MLP hidden width (default 256)")
    c = p.add_argument_group("charlm")
    c.add_argument("--corpus-bytes", type=int, default=2_000_000, help="stdlib bytes to read (default 2000000)")
    c.add_argument("--corpus-files", choices=CORPUS_FILES, default="top",
                   help="top: the *.py files directly in the stdlib directory (default); tree: its packages "
                        "too, without site-packages and test packages")
    c.add_argument("--context", type=int, default=128, help="sequence length in bytes (default 128)")
    c.add_argument("--n-layer", type=int, default=4)
    c.add_argument("--n-head", type=int, default=4)
    c.add_argument("--d-model", type=int, default=128)
    c.add_argument("--eval-windows", type=int, default=128,
                   help="held-out windows per evaluation, evenly spaced over the held-out files; 0: all of them "
                        "(default 128)")
    add_cli_args(p)
    return p


def resolve_args(parser: argparse.ArgumentParser, argv=None):
    """Parse ``argv``, fill task defaults, and build the grad-comm mode and FP8 config (exits with a
    usage error naming the flag or variable on a bad value)."""
    args = parser.parse_args(argv)
    for k, v in TASK_DEFAULTS[args.task].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k in ("steps", "batch_size", "eval_every"):
        if getattr(args, k) < 1:
            parser.error(f"--{k.replace('_', '-')} must be >= 1")
    if not 0.0 <= args.lr_min_ratio <= 1.0:
        parser.error(f"--lr-min-ratio must be in [0, 1], got {args.lr_min_ratio}")
    for flag in ("init_perturbation", "grad_perturbation"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and value >= 0):
            parser.error(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value}")
    if args.grad_perturbation and args.dp != "ddp":
        parser.error("--grad-perturbation needs --dp ddp (each rank perturbs its full gradient alike), "
                     f"got --dp {args.dp}")
    if args.eval_windows < 0:
        parser.error(f"--eval-windows must be >= 0 (0: every held-out window), got {args.eval_windows}")
    if args.dp != "ddp" and not hasattr(fp8_comm_hook, "register_fsdp_hook"):
        parser.error(f"--dp {args.dp} is not yet available: this fp8_comm_hook {fp8_comm_hook.__version__} has no "
                     "register_fsdp_hook (FSDP support is still being written); use --dp ddp")
    if args.lr_warmup_steps is None:
        args.lr_warmup_steps = max(1, args.steps // 20)
    try:
        grad_comm = grad_comm_from_args(args)
        # The demo models fit in one small bucket; the library's default min_compress_numel (sized
        # for real models' buckets) would send it uncompressed, so the trainer compresses everything
        # unless --fp8-min-compress-numel / FP8_COMM_MIN_COMPRESS_NUMEL says otherwise.
        config = config_from_args(args, base=FP8CommConfig(min_compress_numel=0))
    except ValueError as e:
        parser.error(str(e))
    return args, grad_comm, config


# ---------------------------------------------------------------------------------------- data
class ShardSampler:
    """Each epoch a seeded permutation of ``n`` items, cut to a multiple of the world size; rank r
    takes every W-th item from r, in batches of ``batch_size`` (the last partial batch is dropped)."""

    def __init__(self, n: int, batch_size: int, rank: int, world: int, seed: int):
        self.n, self.batch_size, self.rank, self.world, self.seed = n, batch_size, rank, world, seed
        self.per_rank = n // world
        self.batches_per_epoch = self.per_rank // batch_size
        if self.batches_per_epoch < 1:
            raise ValueError(f"{n} training items over {world} ranks cannot fill one batch of {batch_size}")
        self._epoch, self._mine = None, None

    def batch(self, step: int) -> torch.Tensor:
        """Indices of this rank's batch for global step ``step`` (0-based)."""
        epoch, i = divmod(step, self.batches_per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.n, generator=g)[: self.per_rank * self.world]
            self._epoch, self._mine = epoch, perm[self.rank::self.world]
        return self._mine[i * self.batch_size:(i + 1) * self.batch_size]


def load_digits_split(device):
    """scikit-learn's digits: (x_train, y_train, x_eval, y_eval) on ``device``, a fixed 80/20 split,
    standardized with the training statistics."""
    from sklearn.datasets import load_digits

    ds = load_digits()
    x = torch.tensor(ds.data, dtype=torch.float32)
    y = torch.tensor(ds.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_eval = int(round(len(y) * DIGITS_HELD_OUT))
    ev, tr = perm[:n_eval], perm[n_eval:]
    mean, std = x[tr].mean(0), x[tr].std(0)
    std = torch.where(std < 1e-6, torch.ones_like(std), std)
    x = (x - mean) / std
    return x[tr].to(device), y[tr].to(device), x[ev].to(device), y[ev].to(device)


def stdlib_source_files(root: str, files: str = "top") -> list:
    """The ``*.py`` files of the charlm corpus under ``root``, as sorted ``/``-separated paths relative
    to it: those directly in ``root`` (``files="top"``) or in its whole tree (``"tree"``, skipping
    :data:`CORPUS_SKIP_DIRS` at any depth)."""
    if files not in CORPUS_FILES:
        raise ValueError(f"files must be one of {CORPUS_FILES}, got {files!r}")
    if files == "top":
        return sorted(f for f in os.listdir(root) if f.endswith(".py") and os.path.isfile(os.path.join(root, f)))
    found = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in CORPUS_SKIP_DIRS]
        rel = os.path.relpath(d, root)
        for f in names:
            if f.endswith(".py"):
                found.append(f if rel == "." else "/".join(rel.split(os.sep) + [f]))
    return sorted(found)


def load_stdlib_corpus(max_bytes: int, files: str = "top"):
    """The charlm corpus: the :func:`stdlib_source_files` of this interpreter's stdlib directory,
    read in order until ``max_bytes`` (the last file cut short); file i goes to the held-out set when
    i % 10 == 9 (the last file when fewer than 10). Returns (train uint8 tensor, eval uint8 tensor,
    info dict with the Python version, file counts and a sha256 of the corpus)."""
    root = sysconfig.get_paths()["stdlib"]
    names = stdlib_source_files(root, files)
    if not names:
        raise RuntimeError(f"no *.py files in the stdlib directory {root!r} (a zipped stdlib?); charlm needs them")
    chunks, total = [], 0
    for name in names:
        if total >= max_bytes:
            break
        with open(os.path.join(root, *name.split("/")), "rb") as f:
            data = f.read(max_bytes - total)
        chunks.append((name, data))
        total += len(data)
    if len(chunks) < 2:
        raise RuntimeError(f"--corpus-bytes {max_bytes} covers {len(chunks)} file(s); need >= 2 to hold one out")
    eval_idx = {i for i in range(len(chunks)) if i % EVAL_FILE_EVERY == EVAL_FILE_EVERY - 1} or {len(chunks) - 1}
    digest = hashlib.sha256()
    for name, data in chunks:
        digest.update(name.encode() + b"\0" + data + b"\0")
    train = b"".join(d for i, (_, d) in enumerate(chunks) if i not in eval_idx)
    held = b"".join(d for i, (_, d) in enumerate(chunks) if i in eval_idx)
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).clone()  # noqa: E731
    info = {"python_version": sys.version.split()[0], "corpus_files": files, "stdlib_files": len(chunks),
            "held_out_files": len(eval_idx), "train_bytes": len(train), "eval_bytes": len(held),
            "sha256": digest.hexdigest()}
    return as_tensor(train), as_tensor(held), info


# ---------------------------------------------------------------------------------------- models
class MLP(nn.Module):
    """Two hidden GELU layers."""

    def __init__(self, d_in: int, hidden: int, n_out: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d_in, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, n_out)])

    def forward(self, x):
        """Logits for a batch of feature vectors."""
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x

    def fsdp_units(self):
        """Submodules FSDP2 shards on their own."""
        return list(self.layers)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        """x: (B, T, d) -> (B, T, d)."""
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
    """A GPT-style causal language model over bytes (vocabulary 256, learned positions)."""

    def __init__(self, context: int, d: int, n_layer: int, n_head: int):
        super().__init__()
        if d % n_head:
            raise ValueError(f"--d-model {d} must be a multiple of --n-head {n_head}")
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, 256, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for b in self.blocks:  # GPT-2's scaled init of the residual projections
            for m in (b.proj, b.out):
                nn.init.normal_(m.weight, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx):
        """idx: (B, T) byte ids -> logits (B, T, 256)."""
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))

    def fsdp_units(self):
        """Submodules FSDP2 shards on their own."""
        return list(self.blocks)


# ---------------------------------------------------------------------------------------- tasks
class DigitsTask:
    """Classification of 8x8 digits; eval reports loss and accuracy."""

    has_accuracy = True

    def __init__(self, args, device, rank, world):
        self.x, self.y, self.xe, self.ye = load_digits_split(device)
        self.sampler = ShardSampler(len(self.y), args.batch_size, rank, world, args.seed)
        self.eval_idx = torch.arange(len(self.ye))[rank::world]
        self.info = {"train_examples": len(self.y), "eval_examples": len(self.ye)}
        self.args = args

    def build_model(self):
        """The MLP."""
        return MLP(self.x.shape[1], self.args.hidden, 10)

    def loss(self, model, step):
        """Training loss on this rank's batch for ``step``."""
        i = self.sampler.batch(step).to(self.x.device)
        return F.cross_entropy(model(self.x[i]), self.y[i])

    def eval_sums(self, model):
        """(sum of losses, hits, count) over this rank's share of the held-out set."""
        tot = torch.zeros(3, dtype=torch.float64, device=self.x.device)
        for s in range(0, len(self.eval_idx), EVAL_BATCH):
            i = self.eval_idx[s:s + EVAL_BATCH].to(self.x.device)
            logits = model(self.xe[i])
            tot[0] += F.cross_entropy(logits, self.ye[i], reduction="sum").double()
            tot[1] += (logits.argmax(1) == self.ye[i]).sum().double()
            tot[2] += len(i)
        return tot


class CharLMTask:
    """Next-byte prediction on the stdlib's source; eval reports loss (nats per byte)."""

    has_accuracy = False

    def __init__(self, args, device, rank, world):
        train, held, self.info = load_stdlib_corpus(args.corpus_bytes, args.corpus_files)
        T = args.context
        self.n_windows = (len(train) - 1) // T
        self.train, self.held, self.T, self.device = train.to(device), held.to(device), T, device
        self.sampler = ShardSampler(self.n_windows, args.batch_size, rank, world, args.seed)
        total = (len(held) - 1) // T
        if total < 1:
            raise RuntimeError(f"held-out text ({len(held)} bytes) is shorter than --context {T}")
        m = min(args.eval_windows, total) if args.eval_windows else total
        starts = torch.tensor([(k * total // m) * T for k in range(m)])
        self.eval_starts = starts[rank::world]
        self.info.update(train_windows=self.n_windows, eval_windows=m)
        self.args = args

    def build_model(self):
        """The byte-level transformer."""
        a = self.args
        return CharGPT(a.context, a.d_model, a.n_layer, a.n_head)

    def _windows(self, data, starts):
        offs = starts.to(self.device)[:, None] + torch.arange(self.T + 1, device=self.device)
        w = data[offs].long()
        return w[:, :-1], w[:, 1:]

    def loss(self, model, step):
        """Training loss on this rank's batch of windows for ``step``."""
        x, y = self._windows(self.train, self.sampler.batch(step) * self.T)
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    def eval_sums(self, model):
        """(sum of per-byte losses, 0, bytes) over this rank's held-out windows."""
        tot = torch.zeros(3, dtype=torch.float64, device=self.device)
        for s in range(0, len(self.eval_starts), EVAL_BATCH):
            x, y = self._windows(self.held, self.eval_starts[s:s + EVAL_BATCH])
            tot[0] += F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").double()
            tot[2] += y.numel()
        return tot


TASKS = {"digits": DigitsTask, "charlm": CharLMTask}


# ---------------------------------------------------------------------------------------- parallelism
def setup_distributed(args):
    """Init the process group (torchrun's env; a world of one without it) and pick the device.
    Returns (rank, world, backend, device)."""
    if "RANK" not in os.environ:  # plain `python scripts/train.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    backend = args.backend if args.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise SystemExit("--backend nccl needs CUDA (use --backend gloo on CPU)")
    if use_cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=10))
    return dist.get_rank(), dist.get_world_size(), backend, device


def wrap_model(net, args, device, grad_comm, config):
    """Wrap ``net`` for ``--dp`` and set up gradient communication. Returns (model, FP8CommState or
    None, dtype on the wire for none/bf16 or None, collective ("all_reduce"/"reduce_scatter"))."""
    if args.dp == "ddp":
        model = nn.parallel.DistributedDataParallel(
            net, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_cap_mb)
        state = register_grad_comm(model, grad_comm, config)
        return model, state, grad_comm_wire_dtype(model), "all_reduce"
    register_fsdp_hook = getattr(fp8_comm_hook, "register_fsdp_hook", None)
    if register_fsdp_hook is None:
        raise SystemExit(f"--dp {args.dp} is not yet available: this fp8_comm_hook {fp8_comm_hook.__version__} has no "
                         "register_fsdp_hook (FSDP support is still being written); use --dp ddp")
    reduce_dtype = torch.bfloat16 if grad_comm == "bf16" else None
    if args.dp == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

        mp = MixedPrecision(reduce_dtype=reduce_dtype) if reduce_dtype is not None else None
        model = FullyShardedDataParallel(net, device_id=device,  # explicit: FSDP1 refuses CPU otherwise
                                         mixed_precision=mp, use_orig_params=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # torch >= 2.6

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        for unit in net.fsdp_units():
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        model = fully_shard(net, mesh=mesh, mp_policy=policy)
    state = register_fsdp_hook(model, config) if grad_comm == "fp8" else None
    wire = None if grad_comm == "fp8" else (torch.bfloat16 if grad_comm == "bf16" else torch.float32)
    return model, state, wire, "reduce_scatter"


def comm_bytes(numel: int, elem_bytes: int, world: int, collective: str) -> int:
    """Bytes one rank sends for ``numel`` gradients: ring all-reduce 2(W-1)/W, reduce-scatter (W-1)/W."""
    return ring_bytes(collective, numel * elem_bytes, world)


def clip_grads(model, max_norm: float):
    """Clip the global gradient norm (FSDP1 has its own method, which knows about shards)."""
    if max_norm <= 0:
        return
    if hasattr(model, "clip_grad_norm_"):
        model.clip_grad_norm_(max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


# ---------------------------------------------------------------------------------------- main
def lr_at(step: int, args) -> float:
    """Linear warm-up over ``--lr-warmup-steps``, then cosine decay to ``--lr-min-ratio`` of ``--lr``."""
    if step < args.lr_warmup_steps:
        return args.lr * (step + 1) / args.lr_warmup_steps
    t = (step - args.lr_warmup_steps) / max(1, args.steps - args.lr_warmup_steps)
    floor = args.lr_min_ratio
    return args.lr * (floor + (1.0 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def perturbations():
    """The convergence study's perturbation functions (``studies/perturb.py``: ``perturb_init``,
    ``perturb_grads``), imported only when ``--init-perturbation`` or ``--grad-perturbation`` is set:
    the plain trainer does without them."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from studies import perturb

    return perturb


def evaluate(task, model, step: int) -> dict:
    """Held-out loss (and accuracy) over the full set: each rank its share, one SUM all-reduce."""
    model.eval()
    with torch.no_grad():
        tot = task.eval_sums(model)
    model.train()
    dist.all_reduce(tot)
    tot = tot.tolist()
    out = {"step": step, "eval_loss": tot[0] / tot[2]}
    out["accuracy"] = tot[1] / tot[2] if task.has_accuracy else None
    return out


def main(argv=None):
    """Train, evaluate, print the summary (rank 0) and write ``--log-json``; returns the summary."""
    parser = build_parser()
    args, grad_comm, config = resolve_args(parser, argv)
    rank, world, backend, device = setup_distributed(args)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=f"[rank{rank}] %(message)s")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        summary = train(args, grad_comm, config, rank, world, backend, device)
        # The model, its reducer and the hook state are gone now; leave together, then tear the group
        # down while the interpreter is still whole (gloo threads die badly at interpreter exit).
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return summary


def train(args, grad_comm, config, rank, world, backend, device) -> dict:
    """The training run proper (see :func:`main`)."""
    task = TASKS[args.task](args, device, rank, world)
    if args.task == "charlm":  # every rank must have read the same corpus
        digests = [None] * world
        dist.all_gather_object(digests, task.info["sha256"])
        if len(set(digests)) != 1:
            raise RuntimeError(f"ranks read different stdlib corpora (Python versions differ?): {digests}")
    torch.manual_seed(args.seed)
    net = task.build_model()
    if args.init_perturbation:
        perturbations().perturb_init(net, args.init_perturbation, args.init_perturbation_seed)
    net = net.to(device)
    numel = sum(p.numel() for p in net.parameters() if p.requires_grad)
    elem = next(net.parameters()).element_size()
    model, state, wire_dtype, collective = wrap_model(net, args, device, grad_comm, config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if rank == 0:
        log.info("task %s: %d parameters, %s on %s, world %d, %s, grad_comm=%s, %s", args.task, numel,
                 args.dp, device, world, backend, grad_comm, task.info)
    progress = None
    if rank == 0 and not args.no_progress:
        try:
            from tqdm import tqdm
            progress = tqdm(total=args.steps, desc=f"{args.task} {grad_comm}", dynamic_ncols=True)
        except ImportError:
            pass
    losses = torch.zeros(args.steps, dtype=torch.float64, device=device)
    perturb_grads, grad_gen = None, None
    if args.grad_perturbation:
        perturb_grads = perturbations().perturb_grads
        grad_gen = torch.Generator(device=device).manual_seed(args.grad_perturbation_seed)
    lrs, evals = [], [evaluate(task, model, 0)]
    t0 = time.perf_counter()
    for step in range(args.steps):
        lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        lrs.append(lr)
        loss = task.loss(model, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if perturb_grads is not None:
            perturb_grads(model, args.grad_perturbation, grad_gen)
        clip_grads(model, args.grad_clip)
        opt.step()
        losses[step] = loss.detach().double()
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            evals.append(evaluate(task, model, done))
        if progress is not None:
            progress.update(1)
            if done % 10 == 0 or done == args.steps:
                progress.set_postfix(loss=f"{loss.item():.4f}", eval=f"{evals[-1]['eval_loss']:.4f}")
    train_time = time.perf_counter() - t0
    if progress is not None:
        progress.close()
    dist.all_reduce(losses)
    losses = (losses / world).tolist()

    if state is not None and not state.ddp_native_all_reduce:   # else auto left DDP's own all-reduce
        hook_stats = state.stats()
        sent, baseline = hook_stats["bytes_sent"], hook_stats["bytes_baseline"]
    else:
        hook_stats = None
        per_step_base = comm_bytes(numel, elem, world, collective)
        wire_elem = torch.empty((), dtype=wire_dtype).element_size() if wire_dtype is not None else elem
        sent = args.steps * comm_bytes(numel, wire_elem, world, collective)
        baseline = args.steps * per_step_base
    final = evals[-1]
    summary = {
        "task": args.task, "grad_comm": grad_comm, "dp": args.dp, "backend": backend, "device": str(device),
        "world_size": world, "seed": args.seed, "steps": args.steps, "batch_size_per_rank": args.batch_size,
        "lr": args.lr, "parameters": numel,
        "init_perturbation": ({"rel": args.init_perturbation, "seed": args.init_perturbation_seed}
                              if args.init_perturbation else None),
        "grad_perturbation": ({"rel": args.grad_perturbation, "seed": args.grad_perturbation_seed}
                              if args.grad_perturbation else None),
        "initial_eval_loss": evals[0]["eval_loss"], "final_eval_loss": final["eval_loss"],
        "final_accuracy": final["accuracy"], "final_train_loss": sum(losses[-10:]) / len(losses[-10:]),
        "bytes_sent": sent, "bytes_baseline": baseline,
        "wire_ratio": sent / baseline if baseline else None,
        "hook_stats": hook_stats, "fp8_config": config.to_dict() if grad_comm == "fp8" else None,
        "train_time_s": train_time, "torch_version": torch.__version__,
        "python_version": sys.version.split()[0], "data": task.info,
    }
    if rank == 0:
        acc = "" if final["accuracy"] is None else f", accuracy {100 * final['accuracy']:.2f}%"
        print(f"held-out loss {final['eval_loss']:.4f} (initial {evals[0]['eval_loss']:.4f}){acc} "
              f"after {args.steps} steps, {train_time:.1f} s")
        ratio = "n/a" if summary["wire_ratio"] is None else f"{summary['wire_ratio']:.3f}x"
        print(f"gradient bytes sent per rank ({grad_comm}): {sent / 1e6:.3f} MB vs {baseline / 1e6:.3f} MB for an "
              f"fp32 ring {collective.replace('_', '-')} ({ratio})")
        if hook_stats is not None:
            print(f"hook stats: {hook_stats}")
        if args.log_json:
            record = {"args": vars(args), "steps": [{"step": i + 1, "loss": l, "lr": r}
                                                   for i, (l, r) in enumerate(zip(losses, lrs))],
                      "evals": evals, "summary": summary}
            tmp = args.log_json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(record, f, indent=1)
            os.replace(tmp, args.log_json)
    return summary


if __name__ == "__main__":
    main()
