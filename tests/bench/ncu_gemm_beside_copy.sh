#!/usr/bin/env bash
# Nsight Compute counters of bf16 GEMMs alone and beside a one-CTA copy kernel
# (tests/bench/ncu_gemm_beside_copy.py), one range each (--replay-mode range), device-wide.
# Each metric group runs on its own so that a name this ncu lacks fails alone. Needs CuPy.
#   OUT=results bash tests/bench/ncu_gemm_beside_copy.sh
set -uo pipefail
OUT=${OUT:-ncu-results}
RAW=${RAW:-$OUT/raw}
mkdir -p "$OUT" "$RAW"
NCU=${NCU:-ncu}
ncu_=$(command -v "$NCU" || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
[ -n "$ncu_" ] || { echo "no ncu"; exit 1; }
"$ncu_" --version | tail -n 1
"$ncu_" --query-metrics --chip gh100 > "$RAW/metrics-gh100.txt" 2>&1 || true
grep -iE '^(lts__|pcie__|gpu__|sm__|fbpa__|dram__|l1tex__m|xbar|mmu|gmmu|hub|ltc)' "$RAW/metrics-gh100.txt" \
  | awk '{print $1}' | grep -iE 'sysmem|aperture|pcie|xbar|tlb|mmu|hub|throughput|t_requests|t_sectors$|stall|cycles_active' \
  > "$OUT/metrics-picked.txt" || true
GROUPS_=(
  "gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed"
  "lts__t_sectors_aperture_sysmem.sum,lts__t_sectors_aperture_device.sum,lts__t_requests_srcunit_tex.sum,lts__t_sectors_srcunit_tex.sum"
  "pcie__read_bytes.sum,pcie__write_bytes.sum"
  "lts__t_sector_hit_rate.pct,l1tex__m_xbar2l1tex_read_bytes.sum,l1tex__m_l1tex2xbar_write_bytes.sum"
  "lts__d_sectors_fill_sysmem.sum,lts__d_sectors_fill_device.sum"
)
ALL=$(IFS=,; echo "${GROUPS_[*]}")
for copy in none host host-d2h small device tma; do
  # Every metric in one replay; where this ncu lacks one, each group on its own.
  if timeout 150 "$ncu_" --replay-mode range --clock-control none --metrics "$ALL" --csv \
      python3 tests/bench/ncu_gemm_beside_copy.py --copy "$copy" > "$RAW/ncu-$copy-all.csv" 2> "$RAW/ncu-$copy-all.err"; then
    echo "$copy: ok"
    continue
  fi
  echo "$copy: all metrics at once failed: $(grep -h -m3 -E 'ERROR|WARN|rror' "$RAW/ncu-$copy-all.csv" "$RAW/ncu-$copy-all.err" | tr '\n' ' ')"
  rm -f "$RAW/ncu-$copy-all.csv"
  [ "$copy" = none ] && [ -z "${PER_GROUP:-}" ] && { echo "giving up on range replay"; break; }
  for i in "${!GROUPS_[@]}"; do
    timeout 120 "$ncu_" --replay-mode range --clock-control none \
      --metrics "${GROUPS_[$i]}" --csv python3 tests/bench/ncu_gemm_beside_copy.py --copy "$copy" \
      > "$RAW/ncu-$copy-$i.csv" 2> "$RAW/ncu-$copy-$i.err"
    echo "$copy group $i: exit $? $(grep -h -m2 -E 'ERROR|rror' "$RAW/ncu-$copy-$i.csv" "$RAW/ncu-$copy-$i.err" | tr '\n' ' ')"
  done
done
python3 - "$RAW" <<'EOF'
import csv, glob, io, sys
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(f"{out}/ncu-*.csv")):
    copy = f.rsplit("/", 1)[1].split("-", 1)[1].rsplit("-", 1)[0]
    text = open(f).read()
    lines = text.splitlines()
    head = next((i for i, l in enumerate(lines) if "Metric Name" in l), None)
    if head is None:
        continue
    for r in csv.DictReader(io.StringIO("\n".join(lines[head:]))):
        rows.setdefault(r.get("Metric Name"), {})[copy] = f'{r.get("Metric Value")} {r.get("Metric Unit", "")}'.strip()
copies = ["none", "host", "host-d2h", "small", "device", "tma"]
print("| metric | " + " | ".join(copies) + " |")
print("|---" * (len(copies) + 1) + "|")
for m, v in rows.items():
    print(f"| {m} | " + " | ".join(v.get(c, "") for c in copies) + " |")
EOF
