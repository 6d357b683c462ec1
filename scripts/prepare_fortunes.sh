#!/usr/bin/env bash
# Turns Debian's fortunes-min cookies into byte-level training data: one JSONL line {"tokens": [bytes...]} per
# fortune (the UTF-8 bytes, vocab 256), every 10th fortune held out.
# Usage: scripts/prepare_fortunes.sh OUT_DIR   (writes OUT_DIR/train.jsonl and OUT_DIR/heldout.jsonl)
set -euo pipefail
out=${1:?usage: scripts/prepare_fortunes.sh OUT_DIR}
src=${FORTUNES_DIR:-/usr/share/games/fortunes}
files=()
for f in fortunes literature riddles; do
  [ -f "$src/$f" ] && files+=("$src/$f")
done
if ((${#files[@]} == 0)); then
  echo "error: no fortune files in $src (install the fortunes-min package: scripts/setup.sh)" >&2
  exit 1
fi
mkdir -p "$out"
# od prints every byte as a decimal; awk splits the stream at lines holding just "%" (the cookie separator) and
# writes each cookie's bytes, without the trailing newline, as one JSON line.
cat "${files[@]}" | od -An -v -tu1 | awk -v train="$out/train.jsonl.tmp" -v held="$out/heldout.jsonl.tmp" '
  function flush(   dest, i, s) {
    while (n > 0 && buf[n] == 10) n--          # drop trailing newlines
    if (n >= 8) {
      dest = (count++ % 10 == 9) ? held : train
      s = buf[1]
      for (i = 2; i <= n; i++) s = s ", " buf[i]
      print "{\"tokens\": [" s "]}" > dest
    }
    n = 0
  }
  {
    for (f = 1; f <= NF; f++) {
      b = $f
      buf[++n] = b
      # "\n%\n": the cookie ends before the "%" line.
      if (b == 10 && n >= 3 && buf[n-1] == 37 && buf[n-2] == 10) { n -= 2; flush() }
      else if (b == 10 && n == 2 && buf[1] == 37) { n = 0 }   # a "%" line at the very start
    }
  }
  END { flush() }'
mv "$out/train.jsonl.tmp" "$out/train.jsonl"
mv "$out/heldout.jsonl.tmp" "$out/heldout.jsonl"
echo "prepare_fortunes: $(wc -l <"$out/train.jsonl") training and $(wc -l <"$out/heldout.jsonl") held-out fortunes in $out" >&2
