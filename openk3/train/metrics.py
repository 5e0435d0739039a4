"""What a user sees during training: a live progress bar, metrics.jsonl, and MFU accounting.

MFU counts the FLOPs of one token's forward+backward (3x forward) honestly:
* every matmul of the *activated* parameters: 2 FLOPs per weight (routed experts: k of E;
  embedding lookups are free, the LM head is a matmul);
* MLA softmax attention over a causal sequence of length T: per head, QK^T and PV cost
  2*T*(qk_dim + v_dim) per token, halved for causality;
* KDA chunked recurrence (chunk C=64): per head, intra-chunk products 2*C*(K + V) (halved for
  causality) plus the state read/update 4*K*V.
See docs/training.md for the formula in one place.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from openk3.config import ModelConfig

KDA_CHUNK = 64


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token."""
    from openk3.params import count_parameters

    counts = count_parameters(cfg)
    br = counts["breakdown"]  # "active" already counts k of E routed experts
    active_matmul = counts["active"] - br.get("embedding", 0) - br.get("norms", 0)
    # the head is a matmul even when it is the embedding (tied: counted once, as "embedding");
    # an MTP layer reuses it for a second head matmul
    head = cfg.vocab_size * cfg.hidden_size
    active_matmul += (cfg.num_nextn_predict_layers + cfg.tie_word_embeddings) * head
    fwd = 2.0 * active_matmul
    n_kda = cfg.num_hidden_layers - len(cfg.full_attn_layers)
    n_mla = len(cfg.full_attn_layers) + cfg.num_nextn_predict_layers  # the MTP block is MLA
    fwd += n_mla * cfg.num_attention_heads * 2 * seq_len * (cfg.qk_head_dim + cfg.v_head_dim) / 2
    K = V = cfg.linear_head_dim
    fwd += n_kda * cfg.linear_num_heads * (2 * KDA_CHUNK * (K + V) / 2 + 4 * K * V)
    return 3.0 * fwd


# Dense peaks (FLOP/s) by device name: bf16 tensor cores, and fp32 without TF32 (CUDA cores;
# torch leaves TF32 off for matmuls by default). Other devices get no MFU (NaN), not a guess.
PEAKS = {"H100": (989e12, 67e12), "H200": (989e12, 67e12), "A100": (312e12, 19.5e12)}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Dense peak used as the MFU denominator (H100/H200 SXM: 989 TFLOP/s bf16); for fp32 the
    TF32 tensor-core peak (half of bf16's) when ``torch.backends.cuda.matmul.allow_tf32`` is on,
    else the CUDA cores' fp32 peak. NaN on a CPU and on a GPU not in ``PEAKS``."""
    if device.type != "cuda":
        return float("nan")
    name = torch.cuda.get_device_name(device)
    peaks = next((p for key, p in PEAKS.items() if key in name), None)
    if peaks is None:
        return float("nan")
    if dtype != torch.float32:
        return peaks[0]
    return peaks[0] / 2 if torch.backends.cuda.matmul.allow_tf32 else peaks[1]


class MetricsLog:
    """Append one JSON object per line; flushed so a crash loses nothing already written."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = path, enabled

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"time": time.time(), **row}) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop rows of steps after ``step`` (written before a crash, redone after a resume;
        every row for a run that starts afresh, ``step`` 0) and a line a crash cut short."""
        if self.path.exists():
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and _step_of(line) <= step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            tmp.replace(self.path)


def _step_of(line: str) -> float:
    """The step of a metrics row; infinity for a line that is no row (a write cut short)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ValueError(f"{path} does not exist: is {run_dir} a training run directory?")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e})") from e
    return rows


class Progress:
    """A rich progress bar (step, loss, lr, tokens/s, ETA) on a terminal; plain lines otherwise."""

    def __init__(self, total: int, start: int, enabled: bool = True):
        self.total, self.start, self.enabled = total, start, enabled
        self.live = enabled and sys.stderr.isatty()

    def __enter__(self):
        if self.live:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                       TextColumn, TimeRemainingColumn)

            self.bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                    transient=False)
            self.bar.start()
            self.task = self.bar.add_task("train", total=self.total, completed=self.start, info="")
        return self

    def update(self, step: int, loss: float, lr: float) -> None:
        if self.live:
            self.bar.update(self.task, completed=step, info=f"loss {loss:.3f} lr {lr:.2e}")

    def log_line(self, row: dict) -> None:
        if not self.enabled:
            return
        msg = (f"step {row['step']:>6}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  "
               f"gnorm {row['grad_norm']:.2f}  {row['tokens_per_s']:,.0f} tok/s")
        if "mtp_loss" in row:
            msg += f"  mtp {row['mtp_loss']:.4f}"
        if "val_loss" in row:
            msg += f"  val {row['val_loss']:.4f}"
        if row.get("load_max_over_mean"):
            msg += f"  load max/mean {max(row['load_max_over_mean']):.2f}"
        if "mfu" in row:
            msg += f"  mfu {100 * row['mfu']:.1f}%"
        if self.live:
            self.bar.console.print(msg)
        else:
            print(msg, file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self.live:
            self.bar.stop()
