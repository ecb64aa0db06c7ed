#!/bin/bash
# Graft extree into a QEMU 10.0 source tree: link the project's files into
# QEMU's layout and apply patches/qemu/series in order.
#
#   scripts/graft.sh QEMU_SOURCE_TREE
#
# Idempotent: links are refreshed, patches already applied are kept; when a
# patch in the series changed, it and the ones after it are reverted (from the
# copies kept in the tree's .extree-applied/) and applied again.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
src=${1:?usage: graft.sh QEMU_SOURCE_TREE}
src=$(cd "$src" && pwd)

die() { echo "graft: error: $*" >&2; exit 1; }

# --- links -------------------------------------------------------------------
# Everything the project keeps in QEMU's layout.  Not the backends used by
# the unit tests: QEMU has its own I/O.
mapfile -t files < <(cd "$top" && {
    ls block/extree*.c block/extree*.h block/extree/extree*.c block/extree/extree*.h \
       include/block/extree*.h docs/interop/extree.rst \
       docs/devel/extree.rst block/extree/trace-events \
       block/extree/sources 2>/dev/null
    find tests/qemu-iotests/tests -type f 2>/dev/null
} | grep -v -E '^block/extree/extree-backend\.' | sort -u)

for f in "${files[@]}"; do
    dst=$src/$f
    mkdir -p "$(dirname "$dst")"
    if [ -L "$dst" ] && [ "$(readlink "$dst")" = "$top/$f" ]; then
        continue
    fi
    if [ -e "$dst" ] && [ ! -L "$dst" ]; then
        die "$dst exists in the QEMU tree and is not extree's link: refusing to overwrite it"
    fi
    ln -sfn "$top/$f" "$dst"
done
# A new or removed file changes what meson builds: make ninja re-run meson.
printf '%s\n' "${files[@]}" > "$src/.extree-files.new"
if ! cmp -s "$src/.extree-files.new" "$src/.extree-files" 2>/dev/null; then
    touch "$src/meson.build" "$src/block/meson.build"
fi
mv "$src/.extree-files.new" "$src/.extree-files"

# Links into this checkout whose target is gone.
for d in block block/extree include/block docs/interop docs/devel tests/qemu-iotests/tests; do
    [ -d "$src/$d" ] || continue
    find "$src/$d" -maxdepth 1 -type l -lname "$top/*" | while read -r l; do
        [ -e "$l" ] || rm -f "$l"
    done
done

# --- patches -------------------------------------------------------------------
series=$top/patches/qemu/series
state=$src/.extree-applied
mkdir -p "$state"
touch "$state/list"

mapfile -t want < <(grep -v -E '^\s*(#|$)' "$series")
mapfile -t have < "$state/list"

# Length of the common prefix: same name, same content.
n=0
while [ $n -lt ${#want[@]} ] && [ $n -lt ${#have[@]} ] &&
      [ "${want[$n]}" = "${have[$n]}" ] &&
      cmp -s "$top/patches/qemu/${want[$n]}" "$state/${have[$n]}"; do
    n=$((n + 1))
done

# Revert what was applied after the common prefix, newest first.
for ((i = ${#have[@]} - 1; i >= n; i--)); do
    p=${have[$i]}
    echo "graft: reverting $p (changed or removed from the series)"
    patch -d "$src" -p1 -R -s --batch < "$state/$p" ||
        die "cannot revert $p in $src: restore the tree (or remove it to unpack a fresh one)"
    rm -f "$state/$p"
    printf '%s\n' "${have[@]:0:$i}" | sed '/^$/d' > "$state/list"
done

for ((i = n; i < ${#want[@]}; i++)); do
    p=${want[$i]}
    [ -f "$top/patches/qemu/$p" ] || die "patch $p is listed in patches/qemu/series but missing"
    if ! patch -d "$src" -p1 -s --batch --forward --dry-run < "$top/patches/qemu/$p" >/dev/null 2>&1; then
        patch -d "$src" -p1 --batch --forward --dry-run < "$top/patches/qemu/$p" >&2 || true
        die "patch $p does not apply to $src (QEMU $(cat "$src/VERSION")): refresh it against this tree"
    fi
    patch -d "$src" -p1 -s --batch --forward < "$top/patches/qemu/$p"
    cp "$top/patches/qemu/$p" "$state/$p"
    echo "$p" >> "$state/list"
    echo "graft: applied $p"
done
