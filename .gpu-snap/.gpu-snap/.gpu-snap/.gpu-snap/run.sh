top=$OUT
export OUT=$top/g GPU_CHECK_BUDGET=575 GPU_CHECK_AFTER='bash after.sh'
mkdir -p $OUT
bash scripts/gpu-check.sh > $OUT/gpu-check.out 2>&1
cp $OUT/compare.txt $OUT/summary.txt $OUT/after.log $top/ 2>/dev/null
cd $top && tar czf all.tgz g && rm -rf g
