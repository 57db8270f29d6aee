#!/usr/bin/env python3
# Interleaved medians of `convkit bench` configurations, as ratios to the first.
# `compare.py passes N`: forward vs backward-data vs backward-weights; `compare.py half N`:
# f32 vs f16 vs bf16. N rounds; run from the repository root after `cargo build --release`.
# `compare.py peers N THREADS LAYERS ENGINES [convkit bench args...]`: convkit against peer
# engines (../shared/peers/bench_peers.py, or bench_peers_int8.py when the args hold
# `--dtype u8|i8`; PY = the peers' venv python), interleaved, as convkit/engine ratios of
# GFLOP/s (GOP/s). LAYERS `all` is the whole suite.
import subprocess, csv, io, statistics, sys, json
import os
BIN=os.environ.get("CONVKIT", "target/release/convkit")
dense="resnet50_l1_3x3,resnet50_l2_3x3,resnet50_l3_3x3,resnet50_l4_3x3,yolo_3x3s2_160,deeplab_aspp_3x3d2,resnet50_l1_1x1_reduce,resnet50_l1_1x1_expand,resnet50_l3_1x1_reduce,resnet50_l2_downsample_1x1s2,mobilenetv2_pw_expand,mobilenetv2_pw_project"
dw="mobilenetv2_dw3x3_112,mobilenetv2_dw3x3s2_112,mobilenetv2_dw3x3_28,mobilenetv2_dw3x3_7,convnext_t_dw7x7_56,convnext_t_dw7x7_28,convnext_t_dw7x7_14,convnext_t_dw7x7_7,efficientnet_dw5x5_28"
mode=sys.argv[1]
rounds=int(sys.argv[2]) if len(sys.argv)>2 else 3
if mode=="peers":
    threads, only, engines, extra = sys.argv[3], sys.argv[4], sys.argv[5].split(","), sys.argv[6:]
    py=os.environ.get("PY", os.path.expanduser("~/peers-venv/bin/python"))
    peers=os.environ.get("PEERS", "../shared/peers")
    int8="--dtype" in extra and extra[extra.index("--dtype")+1] in ("u8","i8")
    script,col=("bench_peers_int8.py","gops") if int8 else ("bench_peers.py","gflops")
    if only=="all":
        only=",".join(l.split(",")[0] for l in open("bench/layers.csv") if l.strip() and not l.startswith(("#","name,")))
    res={}
    for r in range(rounds):
        out=subprocess.run([BIN,"bench","--csv","--reps","7","--threads",threads,"--peak","100","--only",only]+extra,capture_output=True,text=True).stdout
        for row in csv.DictReader(io.StringIO(out)):
            if row["ok"]!="ok": print("FAIL convkit",row["layer"],file=sys.stderr); continue
            res.setdefault((row["layer"],"convkit"),[]).append(float(row[col]))
        for e in engines:
            subprocess.run([py,f"{peers}/{script}","--threads",threads,"--layers","bench/layers.csv","--reps","7","--engines",e,"--only",only,"--out","/tmp/compare_peer.csv"],capture_output=True,text=True)
            for row in csv.DictReader(open("/tmp/compare_peer.csv")):
                if row[col]: res.setdefault((row["layer"],e),[]).append(float(row[col]))
    json.dump({f"{k[0]}|{k[1]}":v for k,v in res.items()},open(f"/tmp/compare_peers_{col}_{threads}t.json","w"))
    print(f"layer,convkit_{col}," + ",".join(f"{e}_{col}" for e in engines) + "," + ",".join(f"convkit/{e}" for e in engines) + ",convkit/best," + ",".join(f"round_ratio_{e}" for e in engines))
    for l in only.split(","):
        med={n:statistics.median(res.get((l,n),[float('nan')])) for n in ["convkit"]+engines}
        best=max((med[e] for e in engines if med[e]==med[e]), default=float('nan'))
        # Ratios of the same round (convkit and the engine run back to back) cancel the
        # machine's slow phases better than ratios of medians: print their median too.
        rr=[statistics.median(a/b for a,b in zip(res.get((l,"convkit"),[]),res.get((l,e),[]))) if res.get((l,e)) else float('nan') for e in engines]
        print(l+f",{med['convkit']:.1f},"+",".join(f"{med[e]:.1f}" for e in engines)+","+",".join(f"{med['convkit']/med[e]:.2f}" for e in engines)+f",{med['convkit']/best:.2f},"+",".join(f"{x:.2f}" for x in rr))
    sys.exit(0)
if mode=="passes":
    configs=[("forward",[]),("backward-data",["--pass","backward-data"]),("backward-weights",["--pass","backward-weights"])]
    only=dense+","+dw
else:
    configs=[("f32",[]),("f16",["--dtype","f16"]),("bf16",["--dtype","bf16"])]
    only=dw+",resnet50_l1_3x3,resnet50_l2_3x3,resnet50_l1_1x1_expand,resnet50_l3_1x1_reduce,yolo_3x3s2_160"
res={}
for r in range(rounds):
    for name,extra in configs:
        out=subprocess.run([BIN,"bench","--csv","--reps","5","--threads","1","--peak","100","--only",only]+extra,capture_output=True,text=True).stdout
        for row in csv.DictReader(io.StringIO(out)):
            if row["ok"]!="ok": print("FAIL",name,row["layer"],file=sys.stderr); continue
            res.setdefault((row["layer"],name),[]).append(float(row["gflops"]))
json.dump({f"{k[0]}|{k[1]}":v for k,v in res.items()},open(f"/tmp/compare_{mode}.json","w"))
layers=[l for l in only.split(",")]
base=configs[0][0]
print("layer," + ",".join(f"{n}_gflops" for n,_ in configs) + "," + ",".join(f"{n}/{base}" for n,_ in configs[1:]))
for l in layers:
    med={n:statistics.median(res.get((l,n),[float('nan')])) for n,_ in configs}
    print(l+","+",".join(f"{med[n]:.1f}" for n,_ in configs)+","+",".join(f"{med[n]/med[base]:.2f}" for n,_ in configs[1:]))
