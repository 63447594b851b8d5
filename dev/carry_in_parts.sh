#!/usr/bin/env bash
# Bring a file larger than one device call may carry (64 MiB in all) to the lent GPU machine, over several calls
# made while the machine stays warm (e.g. the ~340 MB libnccl.so.2 of NCCL >= 2.30 for a try of
# two ranks on one GPU, NCCL_MULTI_RANK_GPU_ENABLE=1). Parts travel in .parts/ (ignored: carry it), are moved on
# arrival to .stash/ (ignored, not carried: a warm machine keeps it between calls), and are joined at the end.
#   here:       bash dev/carry_in_parts.sh split FILE            -> .parts/NAME.NN (55 MiB each) + NAME.sha256
#               (then move all but one part out of .parts/ and bring them in one call at a time)
#   each call:  bash dev/carry_in_parts.sh stash                 (first thing in the command)
#   last call:  bash dev/carry_in_parts.sh join NAME DEST        (checks the sha256; DEST: the file to write)
set -euo pipefail
cmd=${1:?usage: carry_in_parts.sh split FILE | stash | join NAME DEST}
case $cmd in
split)
    file=${2:?file}; name=$(basename "$file")
    mkdir -p .parts
    split -b 55m -d "$file" ".parts/$name."
    sha256sum "$file" | cut -d' ' -f1 > ".parts/$name.sha256"
    ls -la .parts/ ;;
stash)
    mkdir -p .stash
    if compgen -G ".parts/*" > /dev/null; then mv .parts/* .stash/; fi
    ls -la .stash/ ;;
join)
    name=${2:?name}; dest=${3:?dest}
    mkdir -p "$(dirname "$dest")"
    cat $(ls .stash/"$name".[0-9]* | sort) > "$dest"
    want=$(cat ".stash/$name.sha256"); got=$(sha256sum "$dest" | cut -d' ' -f1)
    [ "$want" = "$got" ] || { echo "checksum mismatch for $dest: $got, want $want (a part is missing?)"; exit 1; }
    echo "joined $dest ($(stat -c %s "$dest") bytes, sha256 ok)" ;;
*) echo "unknown command $cmd"; exit 2 ;;
esac
