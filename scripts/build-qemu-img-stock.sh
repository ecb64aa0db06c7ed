#!/bin/bash
# Build build/qemu/qemu-img-stock: qemu-img as QEMU ships it, i.e. without
# the patches in patches/qemu/series that change qemu-img.c, linked with the
# very objects of build/qemu/qemu-img.  Tests compare the two binaries'
# output byte for byte (tests/qemu-iotests/tests/extree-map-stock).
#
#   scripts/build-qemu-img-stock.sh QEMU_SOURCE_TREE BUILD_DIR
#
# Run by scripts/build-qemu.sh after ninja has built qemu-img.  The pristine
# qemu-img.c is the tree's with every applied patch that touches it
# reverse-applied (from the copies scripts/graft.sh keeps in the tree's
# .extree-applied/); it is compiled with the command ninja uses for
# qemu-img.c (compile_commands.json) and linked with the command ninja uses
# for qemu-img (ninja -t commands), with the one object substituted.
#
# Incremental: the object is rebuilt when the pristine source or the compile
# command changed or ninja rebuilt qemu-img.c's own object (a header
# changed); the binary is relinked when qemu-img or the object is newer.
set -euo pipefail

src=$(cd "${1:?usage: build-qemu-img-stock.sh QEMU_SOURCE_TREE BUILD_DIR}" && pwd)
blddir=$(cd "${2:?usage: build-qemu-img-stock.sh QEMU_SOURCE_TREE BUILD_DIR}" && pwd)

die() { echo "build-qemu-img-stock: error: $*" >&2; exit 1; }

state=$src/.extree-applied
out=$blddir/qemu-img-stock.p
obj=$out/qemu-img.c.o
mkdir -p "$out"
[ -f "$blddir/qemu-img" ] || die "$blddir/qemu-img is not built"
[ -f "$blddir/qemu-img.p/qemu-img.c.o" ] || die "$blddir/qemu-img.p/qemu-img.c.o is missing"

# --- pristine qemu-img.c -------------------------------------------------------
tmp=$(mktemp -d "${TMPDIR:-/tmp}/qemu-img-stock.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
cp "$src/qemu-img.c" "$tmp/qemu-img.c"
if [ -f "$state/list" ]; then
    mapfile -t applied < "$state/list"
    for ((i = ${#applied[@]} - 1; i >= 0; i--)); do
        [ -n "${applied[$i]}" ] || continue
        p=$state/${applied[$i]}
        grep -q '^+++ b/qemu-img\.c\([[:space:]]\|$\)' "$p" || continue
        # Only qemu-img.c's part of the patch; $tmp is outside any git
        # repository, so git apply behaves like patch(1), but exactly.
        (cd "$tmp" && git apply -R -p1 --include=qemu-img.c "$p") ||
            die "cannot reverse-apply ${applied[$i]} to qemu-img.c"
    done
fi

# --- compile -------------------------------------------------------------------
cmd=$(python3 - "$blddir" "$out/qemu-img.c" "$obj" <<'EOF'
import json, os, shlex, sys
blddir, source, obj = sys.argv[1:]
for e in json.load(open(os.path.join(blddir, 'compile_commands.json'))):
    if e['file'].endswith('/qemu-img.c') and e.get('output') == 'qemu-img.p/qemu-img.c.o':
        break
else:
    sys.exit("qemu-img.c is not in compile_commands.json")
args = shlex.split(e['command'])
new = []
skip = False
for i, a in enumerate(args):
    if skip:
        skip = False
        continue
    if a in ('-MD', '-MMD'):
        continue
    if a in ('-MQ', '-MF', '-MT'):
        skip = True
        continue
    if a == '-o':
        new += ['-o', obj]
        skip = True
        continue
    if a == '-c':
        new += ['-c', source]
        skip = True
        continue
    new.append(a)
assert '-c' in new and '-o' in new
print(shlex.join(new))
EOF
) || die "no compile command for qemu-img.c in $blddir/compile_commands.json"

need_cc=0
if [ ! -f "$obj" ] || [ "$blddir/qemu-img.p/qemu-img.c.o" -nt "$obj" ] ||
   ! cmp -s "$tmp/qemu-img.c" "$out/qemu-img.c" ||
   [ "$cmd" != "$(cat "$out/compile-command" 2>/dev/null)" ]; then
    need_cc=1
fi
if [ $need_cc = 1 ]; then
    echo "build-qemu-img-stock: compiling the pristine qemu-img.c"
    rm -f "$obj" "$out/compile-command"
    cp "$tmp/qemu-img.c" "$out/qemu-img.c"
    (cd "$blddir" && eval "$cmd") || die "compiling the pristine qemu-img.c failed"
    echo "$cmd" > "$out/compile-command"
fi

# --- link ----------------------------------------------------------------------
if [ -f "$blddir/qemu-img-stock" ] && [ "$blddir/qemu-img-stock" -nt "$blddir/qemu-img" ] &&
   [ "$blddir/qemu-img-stock" -nt "$obj" ]; then
    exit 0
fi
link=$(ninja -C "$blddir" -t commands qemu-img | tail -n 1)
link=$(python3 - "$obj" "$link" <<'EOF'
import shlex, sys
obj, link = sys.argv[1:]
args = shlex.split(link)
assert args.count('qemu-img.p/qemu-img.c.o') == 1, "qemu-img.c.o not in the link command"
i = args.index('-o')
assert args[i + 1] == 'qemu-img', "the link command does not write qemu-img"
args[i + 1] = 'qemu-img-stock.tmp'
args[args.index('qemu-img.p/qemu-img.c.o')] = obj
print(shlex.join(args))
EOF
) || die "cannot make the link command from ninja's for qemu-img"
echo "build-qemu-img-stock: linking qemu-img-stock"
(cd "$blddir" && eval "$link") || die "linking qemu-img-stock failed"
mv -f "$blddir/qemu-img-stock.tmp" "$blddir/qemu-img-stock"
