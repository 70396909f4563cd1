"""Our single-process GPT training step vs transformers' LlamaForCausalLM, same config.

One step = forward (per-token loss, mean) + backward + AdamW step. Both models hold the same
weights (ours via `from_hf`), run in the same process, interleaved (ours, theirs, ours, ...)
after warm-up; the medians are compared. Prints `ratio = ours / transformers` (goal <= 1.0).

    python benchmarks/models.py [--layers 4 --hidden 256 --heads 8 --groups 4 --ffn 688
                                 --vocab 4096 --batch 4 --seq 256 --reps 10 --threads 0]
"""

from __future__ import annotations

import argparse
import math
import statistics
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
    return p


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
    t_ours, t_theirs = [], []
    for rep in range(args.reps):
        # Alternate which goes first so a drift in machine speed favours neither.
        pair = ((step_ours, t_ours), (step_theirs, t_theirs))
        for fn, out in pair if rep % 2 == 0 else pair[::-1]:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    result = {"ours": statistics.median(t_ours), "theirs": statistics.median(t_theirs)}
    result["loss_ours"], result["loss_theirs"] = losses
    result["step_ours"] = step_ours  # type: ignore[assignment]
    return result


def main() -> None:
    args = parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    res = compare(args)
    m_ours, m_theirs = res["ours"], res["theirs"]
    print(
        f"config: layers={args.layers} hidden={args.hidden} heads={args.heads} "
        f"groups={args.groups} ffn={args.ffn} vocab={args.vocab} batch={args.batch} "
        f"seq={args.seq} threads={torch.get_num_threads()} reps={args.reps}"
    )
    print(f"first loss: ours {res['loss_ours']:.6f}  transformers {res['loss_theirs']:.6f}")
    print(f"pentatron step median   {m_ours * 1e3:9.2f} ms")
    print(f"transformers step median {m_theirs * 1e3:8.2f} ms")
    print(f"ratio = {m_ours / m_theirs:.3f} (goal <= 1.0)")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            res["step_ours"]()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
