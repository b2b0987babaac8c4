#!/usr/bin/env bash
# The installed client, as a user gets it. Installs the `client` component of this build into a
# temporary prefix, then, by MODE:
#   files         checks the installed tree, compiles each public header alone (a translation
#                 unit that includes only it), checks the library's SONAME and that it exports
#                 the expertd API only;
#   find_package  builds examples/ with CMake through find_package(expertd);
#   pkg-config    builds examples/ with examples/Makefile through pkg-config.
# The two build modes then run the example against the built expertd serving a forged model: it
# acquires one expert and compares its bytes with the GGUF file.
# Exits 77 (ctest: skipped) when the mode needs a tool that is missing.
#
# usage: install_test.sh MODE SOURCE_DIR BUILD_DIR CXX LIBDIR GENERATOR MAKE_PROGRAM
set -euo pipefail
mode=$1 src=$2 build=$3 cxx=$4 libdir=$5 generator=$6 make_program=$7

skip() {
  echo "SKIPPED: $*"
  exit 77
}
die() {
  echo "FAILED: $*" >&2
  exit 1
}

case $mode in
  files | find_package) ;;
  pkg-config)
    pc=${PKG_CONFIG:-pkg-config}
    command -v "$pc" >/dev/null ||
      skip "pkg-config ('$pc') not found: the pkg-config build of the example is not tested"
    command -v make >/dev/null || skip "make not found: examples/Makefile is not tested"
    ;;
  *) die "unknown mode '$mode' (files, find_package, pkg-config)" ;;
esac

work=$(mktemp -d /tmp/expertd-install-XXXXXX)
prefix=$work/prefix
pid=
cleanup() {
  if [ -n "$pid" ]; then
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# Only the client component: the daemon's files include /etc/expertd, outside any prefix.
cmake --install "$build" --component client --prefix "$prefix" >"$work/install.log" ||
  die "cmake --install $build --component client: $(cat "$work/install.log")"
lib=$prefix/$libdir/libexpertd-client.so
[ -e "$lib" ] || die "$lib was not installed (is expertd_client_shared built?)"

if [ "$mode" = files ]; then
  (cd "$prefix" && find . -type f -o -type l | sort)
  for f in include/expertd/client.h include/expertd/protocol.h include/expertd/result.h \
    share/expertd/expertd.capnp "$libdir/cmake/expertd/expertdConfig.cmake" \
    "$libdir/cmake/expertd/expertdConfigVersion.cmake" \
    "$libdir/cmake/expertd/expertdTargets.cmake" "$libdir/pkgconfig/expertd-client.pc"; do
    [ -f "$prefix/$f" ] || die "$f was not installed"
  done
  for h in "$prefix"/include/expertd/*.h; do
    name=expertd/$(basename "$h")
    echo "#include <$name>" |
      "$cxx" -std=c++20 -Wall -Wextra -Wpedantic -Werror -fsyntax-only -I"$prefix/include" \
        -x c++ - 2>"$work/header.log" ||
      die "<$name> does not compile alone: $(cat "$work/header.log")"
    echo "header alone: <$name> compiles"
  done
  soname=$(objdump -p "$lib" | awk '$1 == "SONAME" { print $2 }')
  [[ $soname =~ ^libexpertd-client\.so\.[0-9]+$ ]] || die "$lib: SONAME '$soname'"
  echo "SONAME $soname"
  # Every exported symbol is expertd's API: no Cap'n Proto, kj or fmt code leaks out.
  foreign=$(nm -D --defined-only "$lib" | awk '{ print $3 }' | c++filt |
    grep -v -e '^expertd::client::' -e '^expertd::abi::' || true)
  [ -z "$foreign" ] || die "$lib exports more than expertd::client and expertd::abi:
$(head -20 <<<"$foreign")"
  echo "exports: $(nm -D --defined-only "$lib" | wc -l) symbols, expertd::client and ::abi only"
  echo "install files: ok"
  exit 0
fi

# Build the example out of tree, against the prefix only.
mkdir -p "$work/build"
if [ "$mode" = find_package ]; then
  cmake -S "$src/examples" -B "$work/build" -G "$generator" -DCMAKE_MAKE_PROGRAM="$make_program" \
    -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_PREFIX_PATH="$prefix" \
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"$work/configure.log" 2>&1 ||
    die "configuring examples/: $(cat "$work/configure.log")"
  ! grep -q "CMake Warning" "$work/configure.log" ||
    die "configuring examples/ warns: $(cat "$work/configure.log")"
  found=$(sed -n 's/^expertd_DIR:PATH=//p' "$work/build/CMakeCache.txt")
  [ "$found" = "$prefix/$libdir/cmake/expertd" ] || die "find_package(expertd) found '$found'"
  cmake --build "$work/build" >"$work/build.log" 2>&1 ||
    die "building examples/: $(cat "$work/build.log")"
else
  PKG_CONFIG_PATH="$prefix/$libdir/pkgconfig" PKG_CONFIG="$pc" \
    make -f "$src/examples/Makefile" -C "$work/build" CXX="$cxx" >"$work/build.log" 2>&1 ||
    die "make -f examples/Makefile: $(cat "$work/build.log")"
fi
exe=$work/build/acquire_one
[ -x "$exe" ] || die "$exe was not built"
# It must run with the installed library, not one from the build tree or the system.
used=$(ldd "$exe" | awk '$1 ~ /^libexpertd-client\.so/ { print $3 }')
if [ -z "$used" ] || [ "$(realpath "$used")" != "$(realpath "$lib")" ]; then
  die "$exe loads libexpertd-client from '$used', not $prefix"
fi
echo "built with $mode: $exe (libexpertd-client from the prefix)"

# The real daemon on a temporary socket, serving a forged model.
bin=$build/bin
"$bin/expert-forge" --layers 2 --experts 4 --top-k 2 --embd 256 --ff 256 -o "$work/m.gguf" \
  >"$work/forge.log" 2>&1 || die "expert-forge: $(cat "$work/forge.log")"
: >"$work/expertd.log"
"$bin/expertd" --model "m=$work/m.gguf" --socket "$work/run/expertd.sock" --cache 16MiB \
  --no-mlock 2>"$work/expertd.log" &
pid=$!
# expertd logs "expertd ready" once its socket listens.
deadline=$((SECONDS + 20))
until grep -q "expertd ready" "$work/expertd.log"; do
  kill -0 "$pid" 2>/dev/null || die "expertd exited at start: $(cat "$work/expertd.log")"
  ((SECONDS < deadline)) || die "expertd not ready after 20 s: $(cat "$work/expertd.log")"
  sleep 0.05
done

"$exe" "$work/run/expertd.sock" m "$work/m.gguf" || die "acquire_one failed (exit status $?)"

kill -TERM "$pid"
status=0
wait "$pid" || status=$?
pid=
[ "$status" -eq 0 ] || die "expertd exited with status $status: $(cat "$work/expertd.log")"
echo "install $mode: ok"
