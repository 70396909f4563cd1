"""Our single-process GPT training step vs transformers' LlamaForCausalLM, same config.

One step = forward (per-token loss, mean) + backward + AdamW step. Both models hold the same
weights (ours via `from_hf`), run in the same process, interleaved (ours, theirs, ours, ...)
after warm-up; the medians are compared. Prints `ratio = ours / transformers` (goal <= 1.0).

    python benchmarks/models.py [--layers 4 --hidden 256 --heads 8 --groups 4 --ffn 688
                                 --vocab 4096 --batch 4 --seq 256 --reps 10 --threads 0]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (
        ("layers", 4), ("hidden", 256), ("heads", 8), ("groups", 4), ("ffn", 688),
        ("vocab", 4096), ("batch", 4), ("seq", 256), ("reps", 10), ("warmup", 2),
        ("threads", 0),
    ):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of ours")
    return p.parse_args()


def main() -> None:
    args = _args()
    if args.threads:
        torch.set_num_threads(args.threads)
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
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-4)

    def step_ours() -> None:
        loss = ours(ids, None, labels=labels).mean()
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)

    def step_theirs() -> None:
        # HF shifts labels inside; same work (one CE over b*s tokens) up to one position.
        loss = theirs(input_ids=ids, labels=labels).loss
        loss.backward()
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step_ours()
        step_theirs()
    t_ours, t_theirs = [], []
    for _ in range(args.reps):
        for fn, out in ((step_ours, t_ours), (step_theirs, t_theirs)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    m_ours, m_theirs = statistics.median(t_ours), statistics.median(t_theirs)
    print(
        f"config: layers={args.layers} hidden={args.hidden} heads={args.heads} "
        f"groups={args.groups} ffn={args.ffn} vocab={args.vocab} batch={args.batch} "
        f"seq={args.seq} threads={torch.get_num_threads()} reps={args.reps}"
    )
    print(f"pentatron step median   {m_ours * 1e3:9.2f} ms")
    print(f"transformers step median {m_theirs * 1e3:8.2f} ms")
    print(f"ratio = {m_ours / m_theirs:.3f} (goal <= 1.0)")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step_ours()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
