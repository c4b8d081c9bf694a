set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 300 python scripts/bench_ffn_train.py --quick --parts '' --densities 0.003,0.01,0.03 --stack 8 --variants dense,sparse,sparse_nosync,auto > $OUT/train.log 2>&1; echo "train rc $?"
timeout 100 python scripts/bench_ffn_train.py --parts '' --densities 0.003 --dists iid --profile --variants sparse_nosync > $OUT/profile.log 2>&1; echo "prof rc $?"
echo "=== train"; grep -v "^#\|^{" $OUT/train.log | tail -30
grep "layers" $OUT/train.log
echo "=== profile"; grep -v "^#" $OUT/profile.log | head -40
