#!/usr/bin/env bash
# check_layers.sh must fail, naming each offence, on a small tree that breaks the rules.
set -euo pipefail
check=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/check_layers.sh
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir -p "$tree"/{base,cache,client/include/expertd,daemon,engine,tools/x}
touch "$tree"/base/fd.h "$tree"/daemon/core.h "$tree"/tools/x/x.h "$tree"/cache/cache.h
printf '#include <vector>\n#include "daemon/core.h"\n' >"$tree"/engine/a.cc
printf '#include <cstdint>\n#include "base/fd.h"\n' >"$tree"/client/include/expertd/c.h
printf '#include "tools/x/x.h"\n' >"$tree"/cache/cache.cc
printf '#include "cache/cache.h"\n' >"$tree"/base/b.cc
printf 'add_library(expertd_cache STATIC cache.cc)\ntarget_link_libraries(expertd_cache\n  PUBLIC x_lib)\ntarget_link_libraries(x_lib PRIVATE expertd_forge)\n' >"$tree"/cache/CMakeLists.txt
set +e
out=$("$check" "$tree")
rc=$?
set -e
echo "$out"
fail=0
for want in \
  'engine/a.cc:2: includes "daemon/core.h": engine/ must not include daemon/' \
  'client/include/expertd/c.h:2: includes "base/fd.h": public headers (*/include/expertd/) may include only <expertd/...> and the standard library' \
  'cache/cache.cc:1: includes "tools/x/x.h": nothing outside tools/ may include tools/' \
  'base/b.cc:1: includes "cache/cache.h": base/ may include only base/' \
  'cache/CMakeLists.txt:2: expertd_cache links expertd_forge (expertd_cache -> x_lib -> expertd_forge)' \
  'check_layers: 5 violation(s)'; do
  grep -qF -- "$want" <<<"$out" || { echo "selftest: missing: $want"; fail=1; }
done
((rc == 1)) || { echo "selftest: check_layers.sh exited $rc, expected 1"; fail=1; }
((fail == 0)) && echo "selftest: OK"
exit $fail
