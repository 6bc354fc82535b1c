#!/usr/bin/env bash
# Another cuDNN (PyPI nvidia-cudnn-cu13) on a GPU machine that has no network, for benchmarks and tests beside the one
# torch ships. torch pins its cuDNN exactly, so a newer one can only be put ahead of it on the loader's path.
#
# The carry has a size limit per call (64 MiB here, with the tree), and the cuDNN wheel unpacks to about 900 MB. The
# frontend's SDPA graphs need only the runtime-fusion engines (every SDPA engine of 9.28, the unified Hopper backward
# included, is named in engines_runtime_compiled and engines_tensor_ir; engines_precompiled names none): libcudnn,
# graph, heuristic, engines_runtime_compiled and engines_tensor_ir, 137 MB as xz for 9.28.1.4, so three parts.
# CUDNN_CARRY_LIBS="all" carries every library (about 440 MB, eight parts) should the lean set refuse a graph.
#
#   here, once (package index; ~7 min of xz on 2 cores):   bash benchmarks/carry_cudnn.sh prepare 9.28.1.4
#       -> .cudnn_carry/part01, part02, ... (git-ignored), each under 53 MiB, each with the manifest and this script
#   device calls back to back, each within ~30 s of the last (a warm machine keeps /tmp), carry [".cudnn_carry/partNN"]:
#       bash .cudnn_carry/partNN/carry_cudnn.sh receive      (the call that brings the last part unpacks)
#   then, in a call on the same warm machine:
#       source <(bash benchmarks/carry_cudnn.sh env) && bash benchmarks/carry_cudnn.sh check && python3 ...
#   `check` runs one SDPA forward and backward through the frontend and fails unless torch and the frontend report the
#   carried version and every cuDNN library mapped into the process comes from the carried folder.
set -uo pipefail
PY=${PYTHON:-python3}
STORE=${CUDNN_CARRY_STORE:-/tmp/cudnn_carry}  # on the device: parts/ as they arrive, site/nvidia/cudnn/lib once unpacked
OUTDIR=.cudnn_carry               # here: one folder per device call
PART_BYTES=$((52 * 1024 * 1024))  # the tree itself is about 6 MiB of the 64
LEAN="libcudnn.so.9 libcudnn_graph.so.9 libcudnn_heuristic.so.9 libcudnn_engines_runtime_compiled.so.9 libcudnn_engines_tensor_ir.so.9"

say() { echo "carry_cudnn: $*" >&2; }

prepare() {
  local version=${1:?usage: carry_cudnn.sh prepare VERSION (e.g. 9.28.1.4)}
  local dl stage lib names
  dl=$(mktemp -d) stage=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$dl" "nvidia-cudnn-cu13==$version" || return 1
  "$PY" -m zipfile -e "$dl"/nvidia_cudnn_cu13-*.whl "$dl/x" || return 1
  lib="$dl/x/nvidia/cudnn/lib"
  if [ "${CUDNN_CARRY_LIBS:-lean}" = all ]; then names=$(cd "$lib" && ls); else names=$LEAN; fi
  mkdir -p "$stage/xz"
  for name in $names; do
    [ -f "$lib/$name" ] || { say "$name is not in the wheel"; return 1; }
    xz -9 -T0 -c "$lib/$name" > "$stage/xz/$name.xz" || return 1  # per library: xz's threads work on one file at a time
  done
  tar -C "$stage/xz" --sort=name --owner=0 --group=0 --numeric-owner -cf "$stage/libs.tar" . || return 1
  rm -rf "$OUTDIR" && mkdir -p "$OUTDIR"
  split -b "$PART_BYTES" -d -a 2 --numeric-suffixes=1 "$stage/libs.tar" "$stage/libs.tar.part" || return 1
  local parts=("$stage"/libs.tar.part*) part n
  {
    echo "version=$version"
    echo "parts=${#parts[@]}"
    echo "sha256=$(sha256sum "$stage/libs.tar" | cut -d' ' -f1)"
    echo "libs=$(echo $names)"
  } > "$stage/manifest"
  for part in "${parts[@]}"; do
    n=${part##*.part}
    mkdir -p "$OUTDIR/part$n"
    mv "$part" "$OUTDIR/part$n/"
    cp "$stage/manifest" "${BASH_SOURCE[0]}" "$OUTDIR/part$n/"
  done
  rm -rf "$dl" "$stage"
  grep -qxF "/$OUTDIR/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo "/$OUTDIR/" >> .git/info/exclude; }
  du -sh "$OUTDIR"/part*
  say "cuDNN $version in ${#parts[@]} parts; carry $OUTDIR/part01, then part02, ... in calls back to back"
}

field() { sed -n "s/^$1=//p" "$2"; }

receive() {  # on the device: this call's part(s) into the store; the last one unpacks
  local here manifest version want have
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  manifest="$here/manifest"
  [ -f "$manifest" ] || { say "no manifest beside $0: carry a folder that prepare made"; return 2; }
  version=$(field version "$manifest")
  mkdir -p "$STORE/parts"
  if [ -f "$STORE/manifest" ] && ! cmp -s "$STORE/manifest" "$manifest"; then
    say "the store held another carry ($(field version "$STORE/manifest")): starting over"
    rm -rf "$STORE" && mkdir -p "$STORE/parts"
  fi
  cp "$manifest" "$STORE/manifest"
  cp "$here"/libs.tar.part* "$STORE/parts/" || return 1
  want=$(field parts "$manifest")
  have=$(ls "$STORE/parts" | wc -l)
  if [ "$have" -lt "$want" ]; then
    say "cuDNN $version: $have of $want parts on this machine; carry the next one within ~30 s"
    return 0
  fi
  unpack
}

unpack() {
  local manifest=$STORE/manifest lib=$STORE/site/nvidia/cudnn/lib sum name
  sum=$(cat "$STORE"/parts/libs.tar.part* | sha256sum | cut -d' ' -f1)
  [ "$sum" = "$(field sha256 "$manifest")" ] || { say "the parts do not add up (sha256 $sum): carry them again"; return 1; }
  rm -rf "$STORE/site" && mkdir -p "$lib"
  cat "$STORE"/parts/libs.tar.part* | tar -C "$lib" -xf - || return 1
  for name in "$lib"/*.xz; do
    if command -v xz > /dev/null; then xz -d "$name" || return 1
    else "$PY" -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[1][:-3], 'wb'))" "$name" && rm "$name" || return 1
    fi
  done
  link_siblings || return 1
  rm -rf "$STORE/parts"
  say "cuDNN $(field version "$manifest") unpacked into $lib ($(du -sh "$lib" | cut -f1)); now: source <(bash benchmarks/carry_cudnn.sh env)"
}

link_siblings() {
  # The engines find NVRTC and cuBLAS through their RUNPATH ($ORIGIN/../../cu13/lib, ../../cublas/lib): point those
  # folders at torch's own, so nothing of the CUDA toolkit is carried or mixed.
  local torch_nvidia sibling
  # the first nvidia folder that is not the store's own (with `env` sourced the store's comes first on sys.path)
  if ! torch_nvidia=$("$PY" -c "import nvidia, os, sys; print([p for p in nvidia.__path__ if not os.path.realpath(p).startswith(os.path.realpath(sys.argv[1]))][0])" "$STORE" 2> /dev/null); then
    say "no nvidia packages beside torch here (a CPU build?): the engines will look for NVRTC on the loader's path"
    return 0
  fi
  for sibling in "$torch_nvidia"/*/; do
    sibling=${sibling%/}
    [ "$(basename "$sibling")" = cudnn ] || ln -sfn "$sibling" "$STORE/site/nvidia/$(basename "$sibling")"
  done
}

env_line() {
  local lib=$STORE/site/nvidia/cudnn/lib
  [ -f "$lib/libcudnn_graph.so.9" ] || { say "nothing unpacked in $lib: receive every part first (on this warm machine)"; return 1; }
  echo "export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # `import torch` also maps the first nvidia/cudnn/lib/libcudnn.so.* it finds along sys.path, by its path
  # (torch/__init__.py, _preload_cuda_deps): the store's site first makes that the carried file too. Without it the
  # H200 (2026-12-05) had torch's own libcudnn.so.9 mapped beside the carried one, unused (torch and the frontend both
  # reported 92801, every engine library was the carried one), and `check` refused the process.
  echo "export PYTHONPATH=$STORE/site${PYTHONPATH:+:$PYTHONPATH}"
  echo "export CUDNN_CARRIED=$(field version "$STORE/manifest")"
}

check() {  # the versions torch and the frontend see, and where every mapped cuDNN library comes from
  "$PY" - "$STORE/site/nvidia/cudnn/lib" <<'PY'
import os, sys

import cudnn
import torch

carried = os.path.realpath(sys.argv[1])
wanted = os.environ.get("CUDNN_CARRIED", "")
major, minor, patch = (int(x) for x in wanted.split(".")[:3]) if wanted else (0, 0, 0)
code = major * 10000 + minor * 100 + patch
print(f"torch {torch.__version__}: cudnn {torch.backends.cudnn.version()}; frontend {cudnn.__version__}: backend {cudnn.backend_version()}")
ok = cudnn.backend_version() == code
if not torch.cuda.is_available():
    print("  no CUDA here: only the frontend's view is checked")
else:  # one SDPA forward and backward through torch's own cuDNN path maps the engines it needs
    ok &= torch.backends.cudnn.version() == code
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    import cudnn_attention  # the package's own graphs, dense and packed with sinks, strict: cuDNN must serve them

    with cudnn_attention.strict():
        cudnn_attention.attention(q, q, q, causal=True).sum().backward()
        tokens = q.detach()[0].transpose(0, 1).contiguous().requires_grad_()
        cu = torch.tensor([0, 100, 256], device="cuda", dtype=torch.int32)
        sinks = torch.zeros(4, device="cuda", requires_grad=True)
        cudnn_attention.varlen_attention(tokens, tokens, tokens, cu, cu, 156, 156, causal=True, sinks=sinks).sum().backward()
    torch.cuda.synchronize()
    print(f"  cudnn_attention served: {cudnn_attention.stats()}")
maps = {line.split()[-1] for line in open("/proc/self/maps") if "libcudnn" in line}
for path in sorted(maps):
    inside = os.path.realpath(path).startswith(carried + os.sep)
    ok &= inside
    print(("  carried " if inside else "  FOREIGN ") + path)
print("carry_cudnn check:", "ok" if ok else f"FAILED (wanted {code} from {carried})")
sys.exit(0 if ok else 1)
PY
}

case "${1:-}" in
  prepare) shift && prepare "$@" ;;
  receive) receive ;;
  env) env_line ;;
  check) check ;;
  *) echo "usage: carry_cudnn.sh prepare VERSION | receive | env | check  (see the header)"; exit 2 ;;
esac
