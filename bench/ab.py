#!/usr/bin/env python3
# Interleaved A/B of `convkit bench` configurations: ROUNDS rounds, each running every config in turn,
# then per layer the medians and the median of the rounds' ratios to the first config.
# ab.py ROUNDS THREADS LAYERS CONFIG...; CONFIG = "name:args" (convkit bench args; BIN=path picks
# the binary, default target/release/convkit), e.g. "old:BIN=/tmp/old" "new:--kernel wino_f32_f5_2d_avx512".
import subprocess,csv,io,statistics,sys,collections
rounds,threads,layers=int(sys.argv[1]),sys.argv[2],sys.argv[3]
cfgs=[]
for c in sys.argv[4:]:
    name,_,args=c.partition(":"); args=args.split()
    b=[a for a in args if a.startswith("BIN=")]; args=[a for a in args if not a.startswith("BIN=")]
    cfgs.append((name,b[0][4:] if b else "target/release/convkit",args))
res=collections.defaultdict(list)
for r in range(rounds):
    for name,b,args in cfgs:
        out=subprocess.run([b,"bench","--csv","--reps","7","--threads",threads,"--only",layers]+args,capture_output=True,text=True).stdout
        for row in csv.DictReader(io.StringIO(out)):
            if row["ok"]!="ok": print("FAIL",name,row,file=sys.stderr); continue
            res[(row["layer"],name)].append(float(row["gflops"]))
base=cfgs[0][0]
print("layer,"+",".join(n for n,_,_ in cfgs)+","+",".join(f"{n}/{base}" for n,_,_ in cfgs[1:]))
for l in layers.split(","):
    med=[statistics.median(res[(l,n)]) if res[(l,n)] else float('nan') for n,_,_ in cfgs]
    rr=[statistics.median(a/b for a,b in zip(res[(l,n)],res[(l,base)])) if res[(l,n)] else float('nan') for n,_,_ in cfgs[1:]]
    print(l+","+",".join(f"{m:.1f}" for m in med)+","+",".join(f"{x:.3f}" for x in rr))
