set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps .devcarry/wheels/*.whl 2>&1 | tail -1
mkdir -p /tmp/twc && tar -xJf .devcarry/cache.tar.xz -C /tmp/twc
export TWELL_CACHE=/tmp/twc
COMMON="model=tiny trainer=gpu trainer.max_steps=120 trainer.global_batch=16 trainer.micro_batch=8 trainer.log_every=1 trainer.val_every=0 trainer.save_every=60 trainer.resume=never optim=adamw optim.warmup_steps=10 sparsity.l1_coeff=0.05 model.ffn_impl=twell data.cache_dir=/tmp/twc/corpus data.build_if_missing=false eval=disabled logging.wandb_mode=disabled trainer.progress=false"
for mode in step call; do
  timeout 200 python -m train $COMMON model.ffn_host_sync=$mode hydra.run.dir=/tmp/run_$mode > $OUT/train_$mode.log 2>&1; echo "$mode rc $?"
done
python - <<'PY'
import json
def rows(m):
    return [json.loads(l) for l in open(f"/tmp/run_{m}/metrics.jsonl") if '"kind": "train"' in l]
a, b = rows("step"), rows("call")
print("steps", len(a), len(b))
d = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b))
print("max rel loss diff step vs call:", d)
print("redos:", sum(r.get("ffn_backup_redos", 0) for r in a))
for r in a[::10]:
    print(r["step"], round(r["loss"], 4), "l0", round(r["l0_mean"], 2), "nnz_max", r.get("nnz_max"), "tok/s", int(r["tokens_per_s"]))
print("call tok/s (last 50 mean):", sum(r["tokens_per_s"] for r in b[-50:]) / 50, " step:", sum(r["tokens_per_s"] for r in a[-50:]) / 50)
PY
grep -i "redo\|error\|Traceback" $OUT/train_step.log | head -5
