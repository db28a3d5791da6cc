#!/usr/bin/env bash
# attnctl grid end to end on loopback: heatmaps of the attention grid as PNG (decoded with
# Python's zlib: signature, IHDR, chunk CRCs, the stored-block zlib stream and its Adler-32,
# the size the documented layout gives, every cell's colour against NumPy reference weights,
# an axis label) and as SVG (parsed as XML), head mean and one head of one batch item, a grid
# large enough to need several stored deflate blocks, and the bounds on its flags.
#
# usage: attnctl_grid_test.sh ATTNSERVE ATTNCTL
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "${here}/attnctl_test_lib.sh"
ref() { timeout 60 /usr/bin/python3 "${here}/attnctl_reference.py" "$@" || fail "reference: $*"; }

start_server "$1" "$2"
ref inputs "${workdir}"
cd "${workdir}"
inputs=(--query=gq.npy --key=gk.npy --value=gv.npy)
ref_inputs=(--query gq.npy --key gk.npy --value gv.npy)

# Head mean of batch item 0, causal: [12, 12] cells of 8 px, as PNG and SVG.
ctl grid "${inputs[@]}" --causal --png=mean.png --svg=mean.svg >grid.out
grep -qx "wrote mean.png 109x107 px, [0-9]* bytes: mean over heads, batch item 0, 12 queries x 12 keys, cells of 8 px, max weight 1" \
  grid.out || fail "grid output: $(cat grid.out)"
grep -qx "wrote mean.svg 109x107 px, [0-9]* bytes: .*" grid.out || fail "$(cat grid.out)"
[[ $(stat -c %s mean.png) -eq $(sed -n 's/^wrote mean.png [0-9x]* px, \([0-9]*\) bytes.*/\1/p' grid.out) ]] ||
  fail "the printed size is not the file's"
ref png mean.png --lq 12 --lk 12 --cell 8 "${ref_inputs[@]}" --causal
ref svg mean.svg --lq 12 --lk 12 --cell 8

# One head (PER_HEAD) of batch item 1, not causal, cells of 5 px.
ctl grid "${inputs[@]}" --head=2 --batch_index=1 --cell=5 --png=head.png >grid.out
grep -q "head 2, batch item 1, 12 queries x 12 keys, cells of 5 px" grid.out ||
  fail "$(cat grid.out)"
ref png head.png --lq 12 --lk 12 --cell 5 "${ref_inputs[@]}" --head 2 --batch_index 1

# A sliding window with sinks (StreamingLLM's pattern), bottom-right, and ALiBi with a softcap
# on a window both sides: every cell against the NumPy reference, hidden ones dark.
ctl grid "${inputs[@]}" --causal --causal_alignment=bottom_right --window_left=3 \
  --num_sink_tokens=2 --png=window.png >grid.out
ref png window.png --lq 12 --lk 12 --cell 8 "${ref_inputs[@]}" --causal --alignment bottom_right \
  --window_left 3 --sinks 2
ctl grid "${inputs[@]}" --window_left=2 --window_right=1 --alibi_slopes=0.5,0.25,0.125 \
  --softcap=2 --head=1 --png=alibi.png >grid.out
ref png alibi.png --lq 12 --lk 12 --cell 8 "${ref_inputs[@]}" --window_left 2 --window_right 1 \
  --alibi 0.5,0.25,0.125 --softcap 2 --head 1
expect_exit 1 "options.softcap is -1" ctl grid "${inputs[@]}" --softcap=-1 --png=x.png
expect_exit 1 "options.alibi_slopes.shape\[0\] is 1, expected 3" ctl grid "${inputs[@]}" \
  --alibi_slopes=0.5 --png=x.png

# Random inputs, 40 x 150 cells of 4 px: over 65535 bytes of scanlines, so several stored
# blocks; labels on every other row and every fifth column.
ctl grid --demo --heads=2 --kv_heads=2 --query_len=40 --key_len=150 --key_dim=8 \
  --value_dim=8 --cell=4 --png=demo.png >/dev/null
ref png demo.png --lq 40 --lk 150 --cell 4

# Bounds and usage.
expect_exit 2 "needs --png or --svg" ctl grid --demo
expect_exit 2 "inputs come from" ctl grid --png=x.png
expect_exit 2 "--png and --svg name one file, same.out" ctl grid --demo --png=same.out \
  --svg=./same.out
expect_exit 2 "--head is 4, expected 0 to 3" ctl grid --demo --heads=4 --kv_heads=4 --head=4 \
  --png=x.png
expect_exit 2 "--batch_index is 2, expected 0 to 1" ctl grid --demo --batch=2 --batch_index=2 \
  --png=x.png
expect_exit 2 "--cell is 0, expected 1 to 64" ctl grid --demo --cell=0 --png=x.png
expect_exit 2 "over 16384 pixels" ctl grid --demo --query_len=4 --key_len=5000 --key_dim=4 \
  --value_dim=4 --png=x.png
expect_exit 2 "cells for --svg" ctl grid --demo --heads=1 --kv_heads=1 --query_len=600 \
  --key_len=600 --key_dim=4 --value_dim=4 --svg=x.svg
[[ -e x.png || -e x.svg ]] && fail "a refused grid wrote a file"

stop_server
echo "PASS"
