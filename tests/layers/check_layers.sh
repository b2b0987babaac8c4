#!/usr/bin/env bash
# The layer rules of docs/ARCHITECTURE.md, checked over the include graph and the CMake link lists.
#
#   check_layers.sh [ROOT]          check; one line per violation, exit 1 if there is any
#   check_layers.sh --graph [ROOT]  print "folder -> folders it includes (include lines)"
#
# ROOT defaults to the source tree this script is in. An include is attributed to the top-level
# folder it resolves to: "dir/x.h" relative to the including file, else to ROOT; "expertd/x.h"
# (quoted or <>) to the folder whose include/expertd/ holds it. Anything else is outside the tree.
set -euo pipefail

usage() { sed -n '2,9s/^# \{0,1\}//p' "$0"; }

mode=check
case "${1:-}" in
  --graph) mode=graph; shift ;;
  -h | --help) usage; exit 0 ;;
  -*) echo "check_layers.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
esac
root=${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
[[ -d $root ]] || { echo "check_layers.sh: ROOT '$root': not a directory" >&2; exit 2; }
cd "$root"

# --- the include graph -----------------------------------------------------------------------

# Sets `to` to the top-level folder an include resolves to, or "" when it is outside the tree.
resolve() {
  local file=$1 delim=$2 inc=$3 dir=${1%/*} d p
  to=""
  if [[ $inc == expertd/* ]]; then
    for d in */include/; do
      [[ -e $d$inc ]] && { to=${d%%/*}; return; }
    done
  fi
  if [[ $delim == '"' && -e $dir/$inc ]]; then
    p=$dir/$inc
    [[ $p == *..* ]] && p=$(realpath -m --relative-to=. "$p")
    to=${p%%/*}
    return
  fi
  # Root-relative, including generated headers ("client/expertd.capnp.h") in a source folder.
  # Only folders with sources count (a system <sys/x.h> is not ./sys).
  d=${inc%%/*}
  if [[ $inc == */* && -n ${tree_dirs[$d]:-} ]]; then to=$d; fi
}

declare -A tree_dirs=()

mapfile -t files < <(find . -type d \( -name .git -o -name '.venv' -o -name 'build*' -o -name node_modules \) \
  -prune -o -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' -o \
  -name '*.hpp' -o -name '*.cpp' -o -name '*.c' \) -print | sed 's|^\./||' | grep / | sort)
for f in "${files[@]}"; do tree_dirs[${f%%/*}]=1; done

# "file:line:from:to:spec" for every include (to is "" when outside the tree).
edges=()
while IFS= read -r hit; do
  file=${hit%%:*}
  rest=${hit#*:}
  line=${rest%%:*}
  text=${rest#*:}
  re='^[[:space:]]*#[[:space:]]*include[[:space:]]*([<"])([^>"]+)[>"]'
  [[ $text =~ $re ]] || continue
  delim=${BASH_REMATCH[1]}
  inc=${BASH_REMATCH[2]}
  resolve "$file" "$delim" "$inc"
  edges+=("$file:$line:${file%%/*}:$to:$delim$inc")
done < <(printf '%s\0' "${files[@]}" | xargs -0 grep -HnE '^[[:space:]]*#[[:space:]]*include')

if [[ $mode == graph ]]; then
  declare -A count=()
  for e in "${edges[@]}"; do
    IFS=: read -r _ _ from to _ <<<"$e"
    [[ -n $to && $to != "$from" ]] && count["$from $to"]=$((${count["$from $to"]:-0} + 1))
  done
  for from in $(printf '%s\n' "${!tree_dirs[@]}" | sort); do
    out=""
    for to in $(printf '%s\n' "${!tree_dirs[@]}" | sort); do
      n=${count["$from $to"]:-0}
      ((n > 0)) && out+="${out:+, }$to ($n)"
    done
    echo "$from -> ${out:-(nothing)}"
  done
  exit 0
fi

# --- the rules -------------------------------------------------------------------------------

# Folders a layer may include, besides itself; unlisted folders are only bound by the global
# rules and the forbidden lists below.
declare -A only=(
  [base]=""
  [storage]="base"
  [client]="base"
  [trace]="storage base"
  [kernels]="storage base"
  [policy]="storage base"
)
declare -A never=(
  [engine]="daemon cache"
  [cache]="forge daemon tools"
)

# Sets `msg` for an include from `from` into `to`, or to "" when it is allowed.
violation() {
  local from=$1 to=$2 top d list
  msg=""
  [[ -z $to || $to == "$from" ]] && return
  for top in tools bench; do
    [[ $to == "$top" ]] && { msg="nothing outside $top/ may include $top/"; return; }
  done
  if [[ -v "only[$from]" ]]; then
    if [[ " ${only[$from]} " != *" $to "* ]]; then
      list="$from/"
      for d in ${only[$from]}; do list+=", $d/"; done
      msg="$from/ may include only $list"
    fi
    return
  fi
  if [[ " ${never[$from]:-} " == *" $to "* ]]; then msg="$from/ must not include $to/"; fi
}

# Public headers (*/include/expertd/) are installed: only <expertd/...> and the standard library.
std_header='^([a-z_0-9]+|sys/[a-z_0-9]+\.h|(stdint|stddef|stdlib|stdio|string|errno|unistd|time|signal|fcntl|limits|assert|inttypes|stdbool)\.h)$'

bad=0
for e in "${edges[@]}"; do
  IFS=: read -r file line from to spec <<<"$e"
  delim=${spec:0:1}
  inc=${spec:1}
  if [[ $delim == '<' ]]; then shown="<$inc>"; else shown="\"$inc\""; fi
  violation "$from" "$to"
  if [[ -z $msg && $file == */include/expertd/* && $inc != expertd/* ]]; then
    if [[ $delim == '"' || ! $inc =~ $std_header ]]; then
      msg="public headers (*/include/expertd/) may include only <expertd/...> and the standard library"
    fi
  fi
  if [[ -n $msg ]]; then
    echo "$file:$line: includes $shown: $msg"
    bad=$((bad + 1))
  fi
done

# The cache core and the daemon's libraries do not link the forge (not even through another
# library): the verifier reaches them only as a LoadChecker from daemon/main.cc.
declare -A links=() where=()
while IFS=' ' read -r at target deps; do
  for d in $deps; do
    links[$target]+=" $d"
    where["$target $d"]=$at
  done
done < <(find . -type d \( -name .git -o -name '.venv' -o -name 'build*' \) -prune -o -name CMakeLists.txt \
  -print | sed 's|^\./||' | sort | while read -r cm; do
  awk -v F="$cm" '
    { sub(/#.*/, "") }
    !in_tll && /target_link_libraries[ \t]*\(/ {
      in_tll = 1; at = F ":" NR; buf = ""; sub(/.*target_link_libraries[ \t]*\(/, "")
    }
    in_tll {
      buf = buf " " $0
      if (index($0, ")")) {
        sub(/\).*/, "", buf); n = split(buf, t, /[ \t]+/); out = ""; tgt = ""
        for (i = 1; i <= n; i++) {
          if (t[i] == "" || t[i] ~ /^(PUBLIC|PRIVATE|INTERFACE)$/ || t[i] ~ /\$/) continue
          if (tgt == "") tgt = t[i]; else out = out " " t[i]
        }
        print at, tgt, out; in_tll = 0
      }
    }' "$cm"
done)

for core in expertd_cache expertd_daemon expertd_rpc; do
  [[ -v "links[$core]" ]] || continue
  declare -A via=([$core]="")
  queue=("$core")
  while ((${#queue[@]})); do
    t=${queue[0]}
    queue=("${queue[@]:1}")
    for d in ${links[$t]:-}; do
      [[ -v "via[$d]" ]] && continue
      via[$d]=$t
      queue+=("$d")
      if [[ $d == expertd_forge || $d == expertd_forge_verify ]]; then
        chain=$d
        x=$d
        while [[ -n ${via[$x]} ]]; do x=${via[$x]}; chain="$x -> $chain"; done
        first=${chain#"$core -> "}
        first=${first%% *}
        echo "${where["$core $first"]}: $core links $d ($chain): the cache core and the" \
          "daemon's libraries must not link the forge"
        bad=$((bad + 1))
      fi
    done
  done
  unset via
done

if ((bad > 0)); then
  echo "check_layers: $bad violation(s) of the layer rules (docs/ARCHITECTURE.md)"
  exit 1
fi
echo "check_layers: OK (${#edges[@]} includes in ${#files[@]} files)"
