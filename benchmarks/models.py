"""Our single-process GPT training step vs transformers' LlamaForCausalLM, same config.

One step = forward (per-token loss, mean) + backward + AdamW step. Both models hold the same
weights (ours via `from_hf`), run in the same process, interleaved (ours, theirs, ours, ...)
after warm-up; the medians are compared. Prints `ratio = ours / transformers` (goal <= 1.0).

The ratio is printed twice. First with glibc's default heap, in this process. Then in a
child process whose heap is never handed back to the OS (MALLOC_TRIM_THRESHOLD_ and
MALLOC_MMAP_THRESHOLD_ fixed, as a caching allocator behaves on a GPU). With the default
heap, glibc returns the top of the heap between AdamW's 4 MiB temporaries and takes page
faults to get it back; how often depends on the holes each model's forward and backward
happen to leave, not on the work done. The page faults per step are printed for both
sides so the difference can be seen; with the heap kept both take few (often none).

    python benchmarks/models.py [--layers 4 --hidden 256 --heads 8 --groups 4 --ffn 688
                                 --vocab 4096 --batch 4 --seq 256 --reps 10 --threads 0
                                 --heap both|default|kept]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

DEFAULTS = (
    ("layers", 4), ("hidden", 256), ("heads", 8), ("groups", 4), ("ffn", 688),
    ("vocab", 4096), ("batch", 4), ("seq", 256), ("reps", 10), ("warmup", 2),
    ("threads", 0),
)  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in DEFAULTS:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of ours")
    p.add_argument(
        "--heap",
        choices=("both", "default", "kept"),
        default="both",
        help="glibc heap policy of the measurement (see the module doc)",
    )
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # child -> parent
    return p


# Below the 32 MiB ceiling glibc accepts for the mmap threshold, so every tensor of the
# benchmark comes from the heap; the trim threshold above any heap it reaches.
KEPT_HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def build(args: argparse.Namespace):
    """(ours, theirs, ids, labels [b, s], HF labels [b, s]): same weights, same data."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pentatron.models.hf import from_hf

    torch.manual_seed(0)
    hf_config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_attention_heads=args.heads,
        num_key_value_heads=args.groups,
        num_hidden_layers=args.layers,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        attn_implementation="sdpa",
    )
    theirs = LlamaForCausalLM(hf_config).train()
    ours = from_hf(theirs).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    labels = torch.randint(0, args.vocab, (args.batch, args.seq))
    # HF pairs logits[:, i] with labels[:, i + 1]; shifting right by one (-100 first) makes
    # it score position i against `labels[:, i]`, as ours does, for i < s - 1.
    hf_labels = torch.cat([torch.full_like(labels[:, :1], -100), labels[:, :-1]], dim=1)
    return ours, theirs, ids, labels, hf_labels


def check_losses(ours, theirs, ids, labels, hf_labels) -> tuple[float, float]:
    """Both models' first losses on the same tokens; raises if they differ."""
    with torch.no_grad():
        loss_ours = ours(ids, None, labels=labels)[:, :-1].mean().item()
        loss_theirs = theirs(input_ids=ids, labels=hf_labels).loss.item()
    if not math.isclose(loss_ours, loss_theirs, rel_tol=1e-4):
        raise AssertionError(f"losses differ: ours {loss_ours} vs transformers {loss_theirs}")
    return loss_ours, loss_theirs


def compare(args: argparse.Namespace) -> dict[str, float]:
    """Median step seconds of ours and transformers, interleaved, after a loss check."""
    ours, theirs, ids, labels, hf_labels = build(args)
    losses = check_losses(ours, theirs, ids, labels, hf_labels)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-4)

    def step_ours() -> None:
        loss = ours(ids, None, labels=labels).mean()
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)

    def step_theirs() -> None:
        loss = theirs(input_ids=ids, labels=hf_labels).loss  # same work: one CE over b*s
        loss.backward()
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step_ours()
        step_theirs()
    t_ours, t_theirs, f_ours, f_theirs = [], [], [], []
    for rep in range(args.reps):
        # Alternate which goes first so a drift in machine speed favours neither.
        pair = ((step_ours, t_ours, f_ours), (step_theirs, t_theirs, f_theirs))
        for fn, out, faults in pair if rep % 2 == 0 else pair[::-1]:
            f0, t0 = _minor_faults(), time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
            faults.append(_minor_faults() - f0)
    result = {"ours": statistics.median(t_ours), "theirs": statistics.median(t_theirs)}
    result["faults_ours"] = float(statistics.mean(f_ours))
    result["faults_theirs"] = float(statistics.mean(f_theirs))
    result["loss_ours"], result["loss_theirs"] = losses
    result["step_ours"] = step_ours  # type: ignore[assignment]
    return result


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def compare_kept_heap(args: argparse.Namespace) -> dict[str, float]:
    """`compare` in a child process whose glibc heap is never trimmed (KEPT_HEAP_ENV)."""
    flags = [f"--{name}={getattr(args, name)}" for name, _ in DEFAULTS]
    cmd = [sys.executable, os.path.abspath(__file__), *flags, "--heap=kept", "--json"]
    out = subprocess.run(
        cmd, env={**os.environ, **KEPT_HEAP_ENV}, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"kept-heap run failed ({' '.join(cmd)}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(title: str, res: dict[str, float]) -> None:
    m_ours, m_theirs = res["ours"], res["theirs"]
    print(f"{title}:")
    print(f"  pentatron step median    {m_ours * 1e3:9.2f} ms  "
          f"({res['faults_ours']:.0f} page faults per step)")  # fmt: skip
    print(f"  transformers step median {m_theirs * 1e3:9.2f} ms  "
          f"({res['faults_theirs']:.0f} page faults per step)")  # fmt: skip
    print(f"  ratio = {m_ours / m_theirs:.3f} (goal <= 1.0)")


def main() -> None:
    args = parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.heap == "kept" and any(os.environ.get(k) != v for k, v in KEPT_HEAP_ENV.items()):
        # glibc reads these once, at start-up: set them by starting again.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **KEPT_HEAP_ENV})
    res = compare(args)
    if args.json:
        print(json.dumps({k: v for k, v in res.items() if isinstance(v, float)}))
        return
    print(
        f"config: layers={args.layers} hidden={args.hidden} heads={args.heads} "
        f"groups={args.groups} ffn={args.ffn} vocab={args.vocab} batch={args.batch} "
        f"seq={args.seq} threads={torch.get_num_threads()} reps={args.reps}"
    )
    print(f"first loss: ours {res['loss_ours']:.6f}  transformers {res['loss_theirs']:.6f}")
    report("glibc default heap" if args.heap != "kept" else "heap kept", res)
    if args.heap == "both":
        report("heap kept (child process, MALLOC_*_THRESHOLD_ fixed)", compare_kept_heap(args))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            res["step_ours"]()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
