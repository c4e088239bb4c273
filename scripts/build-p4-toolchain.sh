#!/usr/bin/env bash
# Build the P4 toolchain the BMv2 tests need from the p4lang sources, on Debian 12 (or Ubuntu 22.04+)
# with the distribution's packages: PI (the P4Runtime server library), BMv2 (simple_switch_grpc,
# simple_switch_CLI), p4c (p4c-bm2-ss, p4test, p4c) and the TNA include files for p4test. About 40
# minutes on 2 cores; run as root.
#
#   sudo bash scripts/build-p4-toolchain.sh                 # clone, build, install into /usr/local
#   PREFIX=/opt/p4 JOBS=4 sudo -E bash scripts/build-p4-toolchain.sh
#   PI_SRC=~/src/PI BMV2_SRC=~/src/behavioral-model P4C_SRC=~/src/p4c P4RUNTIME_SRC=~/src/p4runtime \
#       sudo -E bash scripts/build-p4-toolchain.sh         # use checked-out sources (with submodules)
#   TNA_INCLUDE_SRC=~/src/p4include ...                     # tna.p4's directory where P4C_SRC has no git history
#
# Each *_SRC, when given, must be a checkout of the version below with its git submodules. A stage whose
# tool is already installed is skipped (FORCE=1 rebuilds everything); a stage that fails prints the end of
# its log (under $WORK/logs) and stops.
#
# --with-testgen (or WITH_TESTGEN=1) also builds P4Testgen (p4testgen, its bmv2 target) from the same p4c
# sources, for python -m p4gen.testgen: about 40 more minutes. It needs z3 4.8.14..4.11 (Debian 12 has
# 4.8.12: the z3 library and headers are taken from PyPI's z3-solver 4.11.2.0 wheel, pip download) and
# the inja template library at the commit p4c pins (INJA_SRC, or cloned).
#
# --with-tofino (or WITH_TOFINO=1) also builds the Tofino back end (bf-p4c, p4c-barefoot, bfas) and
# P4Testgen with its tofino target from p4c at $TNA_COMMIT, whose cmake wants Abseil, protobuf 25 and
# other pinned sources (cloned, or *_SRC: ABSEIL_SRC PROTOBUF_SRC INJA_SRC BDWGC_SRC SPDLOG_SRC, and
# P4C_HEAD_SRC for p4c itself), into $TOFINO_PREFIX (default /opt/p4c-head; bf-p4c is linked into
# $PREFIX/bin): about 70 minutes on 2 cores. Two small patches make that commit build with Debian 12's
# GCC 12 and run its driver (see build_tofino).
set -euo pipefail

# ---- versions, pinned in one place ---------------------------------------------------------------
PI_TAG=v0.1.2
BMV2_TAG=1.15.5
P4C_TAG=v1.2.4.8
P4RUNTIME_COMMIT=1e771c4e05c4e7e250df00212b3ca02ee3202d71  # what p4c v1.2.4.8 fetches (CMakeLists.txt)
TNA_COMMIT=34b86e9bac  # a p4c commit whose backends/tofino holds tna.p4 (for p4test on the Tofino program)
INJA_COMMIT=3741c73ba78babd2ed88f2acf2fcd6dafdb878e8  # what p4c v1.2.4.8's testgen fetches
Z3_WHEEL=z3-solver==4.11.2.0  # the z3 p4c v1.2.4.8's P4Testgen is written for (it accepts 4.8.14..4.11)
# what p4c $TNA_COMMIT pins (cmake/Abseil.cmake, cmake/Protobuf.cmake, CMakeLists.txt, cmake/BDWGC.cmake,
# backends/p4tools/modules/testgen/CMakeLists.txt, backends/tofino/cmake/spdlog.cmake, tools/ci-build.sh)
ABSEIL_TAG=20240722.1
PROTOBUF_TAG=v25.3
HEAD_P4RUNTIME_COMMIT=ec4eb5ef70dbcbcbf2f8357a4b2b8c2f218845a5
BDWGC_COMMIT=7f1503dbfe254e77678666a0e09b735add064b57
SPDLOG_TAG=v1.8.3
TOFINO_PY_PACKAGES=(jsl==0.2.4 pyinstaller==6.11.0 jsonschema==4.23.0 pyyaml==6.0.2)

PREFIX=${PREFIX:-/usr/local}
JOBS=${JOBS:-$(nproc)}
WORK=${WORK:-/opt/p4build}
mkdir -p "$WORK/src" "$WORK/logs"

FORCE=${FORCE:-0}
WITH_TESTGEN=${WITH_TESTGEN:-0}
WITH_TOFINO=${WITH_TOFINO:-0}
TOFINO_PREFIX=${TOFINO_PREFIX:-/opt/p4c-head}
for arg in "$@"; do
    case $arg in
        --with-testgen) WITH_TESTGEN=1 ;;
        --with-tofino) WITH_TOFINO=1 ;;
        *) echo "build-p4-toolchain: unknown argument $arg (known: --with-testgen, --with-tofino)" >&2; exit 2 ;;
    esac
done

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# stage NAME LOG COMMAND...: run COMMAND with its output in $WORK/logs/LOG; on failure say which stage
# failed, show the end of its log, and stop.
stage() {
    local name=$1 logfile="$WORK/logs/$2"
    shift 2
    if ! "$@" > "$logfile" 2>&1; then
        echo "build-p4-toolchain: $name failed; the end of $logfile:" >&2
        tail -n 25 "$logfile" >&2
        exit 1
    fi
}

# have TOOL: the tool is installed under $PREFIX and no rebuild was asked for.
have() { [ "$FORCE" != 1 ] && [ -x "$PREFIX/bin/$1" ]; }

# Debian/Ubuntu packages the build and the tools need: compilers and generators, the libraries PI, BMv2
# and p4c link, python3-thrift for the BMv2 CLIs (their `#!/usr/bin/env python3`), and iputils-ping for
# Mininet's pingAll in topologies.star.
PACKAGES=(
    build-essential cmake git pkg-config autoconf automake libtool bison flex libfl-dev
    libboost-dev libboost-iostreams-dev libboost-graph-dev libboost-program-options-dev
    libboost-system-dev libboost-filesystem-dev libboost-thread-dev libgc-dev libgmp-dev
    libprotobuf-dev protobuf-compiler libgrpc++-dev libgrpc-dev protobuf-compiler-grpc
    libpcap-dev libnanomsg-dev libthrift-dev thrift-compiler libjudy-dev libreadline-dev libssl-dev
    libxxhash-dev libjsoncpp-dev python3 python3-six python3-thrift iputils-ping
)

install_packages() {
    if ! command -v apt-get > /dev/null; then
        echo "build-p4-toolchain: no apt-get here; install the equivalents of: ${PACKAGES[*]}" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    local missing=()
    for pkg in "${PACKAGES[@]}"; do
        apt-cache show "$pkg" > /dev/null 2>&1 || missing+=("$pkg")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "build-p4-toolchain: no package named ${missing[*]} in this distribution's registries" >&2
        return 1
    fi
    apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}"
}

# source_dir NAME GIVEN URL REF: print GIVEN if set, else $WORK/src/NAME, cloned from URL at REF if absent.
source_dir() {
    local given=$2 url=$3 ref=$4 dir="$WORK/src/$1"
    if [ -n "$given" ]; then
        echo "$given"
        return
    fi
    if [ ! -d "$dir" ]; then
        git clone -q --recursive "$url" "$dir"
        git -C "$dir" checkout -q "$ref"
        git -C "$dir" submodule update -q --init --recursive
    fi
    echo "$dir"
}

build_pi() {
    local src=$1
    if [ "$FORCE" != 1 ] && [ -e "$PREFIX/lib/libpiprotogrpc.so" ]; then
        log "PI: installed, skipped"
        return
    fi
    log "PI $PI_TAG in $src"
    stage PI pi.log bash -c "cd '$src' && ./autogen.sh && ./configure --prefix='$PREFIX' --with-proto \
        --without-internal-rpc --without-cli --without-bmv2 && make -j$JOBS && make install"
    ldconfig
}

build_bmv2() {
    local src=$1
    if have simple_switch_grpc; then
        log "BMv2: simple_switch_grpc installed, skipped"
        return
    fi
    log "BMv2 $BMV2_TAG in $src"
    # with --with-pi, BMv2 configures, builds and installs targets/simple_switch_grpc too
    stage BMv2 bmv2.log bash -c "cd '$src' && ./autogen.sh && ./configure --prefix='$PREFIX' --with-pi \
        --with-thrift --disable-logging-macros --disable-elogger && make -j$JOBS && make install"
    ldconfig
}

build_p4c() {
    local src=$1 p4runtime=$2
    if have p4c-bm2-ss && have p4test; then
        log "p4c: p4c-bm2-ss and p4test installed, skipped"
        return
    fi
    log "p4c $P4C_TAG in $src"
    mkdir -p "$src/build"
    stage p4c p4c.log bash -c "cd '$src/build' && cmake .. -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_INSTALL_PREFIX='$PREFIX' -DENABLE_GTESTS=OFF -DENABLE_EBPF=OFF -DENABLE_UBPF=OFF \
        -DENABLE_DPDK=OFF -DENABLE_P4TC=OFF -DENABLE_P4C_GRAPHS=OFF -DENABLE_DOCS=OFF \
        -DP4C_USE_PREINSTALLED_PROTOBUF=ON -DENABLE_PROTOBUF_STATIC=OFF \
        -DFETCHCONTENT_SOURCE_DIR_P4RUNTIME='$p4runtime' && make -j$JOBS && make install"
}

install_tna_includes() {
    # tna.p4 and its includes, so that p4test can check the Tofino program (tests/test_p4_tofino.py): from
    # TNA_INCLUDE_SRC (a copy of p4c $TNA_COMMIT's backends/tofino/bf-p4c/p4include), else from the p4c
    # checkout's git history at $TNA_COMMIT.
    local src=$1 dir="$PREFIX/share/p4c/tna-include" sub=backends/tofino/bf-p4c/p4include
    mkdir -p "$dir"
    if [ -n "${TNA_INCLUDE_SRC:-}" ]; then
        log "TNA includes from $TNA_INCLUDE_SRC into $dir"
        cp -r "$TNA_INCLUDE_SRC"/. "$dir"/
        return
    fi
    if ! git -C "$src" rev-parse --git-dir > /dev/null 2>&1; then
        echo "build-p4-toolchain: $src is not a git checkout, so p4c $TNA_COMMIT's $sub cannot be read from" \
            "its history: set TNA_INCLUDE_SRC to a copy of that directory" >&2
        return 1
    fi
    log "TNA includes from p4c $TNA_COMMIT into $dir"
    git -C "$src" cat-file -e "$TNA_COMMIT^{commit}" 2>/dev/null || git -C "$src" fetch -q origin "$TNA_COMMIT"
    git -C "$src" archive "$TNA_COMMIT" "$sub" | tar -x -C "$dir" --strip-components=4
}

# z3 for P4Testgen from the z3-solver wheel: its libz3.so into $PREFIX/lib, its headers into $WORK/z3.
install_z3() {
    local wheel_dir="$WORK/z3-wheel"
    command -v pip3 > /dev/null || command -v pip > /dev/null || {
        echo "build-p4-toolchain: P4Testgen needs pip (python3-pip) to fetch $Z3_WHEEL" >&2; return 1; }
    rm -rf "$wheel_dir" && mkdir -p "$wheel_dir"
    "$(command -v pip3 || command -v pip)" download -q --no-deps -d "$wheel_dir" "$Z3_WHEEL"
    (cd "$wheel_dir" && python3 -m zipfile -e ./*.whl unpacked)
    mkdir -p "$WORK/z3" "$PREFIX/lib"
    rm -rf "$WORK/z3/include" && cp -r "$wheel_dir/unpacked/z3/include" "$WORK/z3/include"
    cp "$wheel_dir"/unpacked/z3/lib/libz3.so* "$PREFIX/lib/"
    ldconfig
}

build_testgen() {
    local src=$1 p4runtime=$2 inja
    if have p4testgen; then
        log "P4Testgen: p4testgen installed, skipped"
        return
    fi
    inja=$(source_dir inja "${INJA_SRC:-}" https://github.com/pantor/inja.git "$INJA_COMMIT")
    log "P4Testgen (p4c $P4C_TAG, bmv2 target) in $src/build-testgen"
    stage "z3 for P4Testgen" z3.log install_z3
    mkdir -p "$src/build-testgen"
    stage P4Testgen testgen.log bash -c "cd '$src/build-testgen' && cmake .. -DCMAKE_BUILD_TYPE=Release \
        -DENABLE_GTESTS=OFF -DENABLE_EBPF=OFF -DENABLE_UBPF=OFF -DENABLE_DPDK=OFF -DENABLE_P4TC=OFF \
        -DENABLE_P4C_GRAPHS=OFF -DENABLE_DOCS=OFF -DENABLE_BMV2=OFF \
        -DP4C_USE_PREINSTALLED_PROTOBUF=ON -DENABLE_PROTOBUF_STATIC=OFF \
        -DFETCHCONTENT_SOURCE_DIR_P4RUNTIME='$p4runtime' -DFETCHCONTENT_SOURCE_DIR_INJA='$inja' \
        -DENABLE_TEST_TOOLS=ON -DENABLE_TOOLS_TARGET_EBPF=OFF -DENABLE_TOOLS_TARGET_PNA=OFF \
        -DTOOLS_USE_PREINSTALLED_Z3=ON -DZ3_INCLUDE_DIR='$WORK/z3/include' -DZ3_LIBRARY='$PREFIX/lib/libz3.so' \
        && make -j$JOBS p4testgen \
        && install -m 755 backends/p4tools/modules/testgen/p4testgen '$PREFIX/bin/p4testgen'"
}

# build_tofino: p4c at $TNA_COMMIT with the Tofino back end and P4Testgen's tofino target.
build_tofino() {
    local src="$WORK/src/p4c-head" deps="$WORK/src/p4c-head-deps" venv="$WORK/venv-p4c-head" p4c_repo=$1
    if [ "$FORCE" != 1 ] && [ -x "$TOFINO_PREFIX/bin/bf-p4c" ] && [ -x "$TOFINO_PREFIX/bin/p4testgen" ]; then
        log "Tofino back end: $TOFINO_PREFIX/bin/bf-p4c installed, skipped"
        ln -sf "$TOFINO_PREFIX/bin/bf-p4c" "$PREFIX/bin/bf-p4c"
        return
    fi
    stage "packages for the Tofino back end" tofino-apt.log apt-get install -y -qq --no-install-recommends \
        rapidjson-dev python3-venv
    [ -e "$WORK/z3/include/z3.h" ] && [ -e "$PREFIX/lib/libz3.so" ] || stage "z3 for P4Testgen" z3.log install_z3
    # p4c itself at $TNA_COMMIT (P4C_HEAD_SRC: an export of that commit), and the sources its cmake pins
    if [ -z "${P4C_HEAD_SRC:-}" ]; then
        git -C "$p4c_repo" cat-file -e "$TNA_COMMIT^{commit}" 2>/dev/null || git -C "$p4c_repo" fetch -q origin "$TNA_COMMIT"
        rm -rf "$src" && mkdir -p "$src"
        git -C "$p4c_repo" archive "$TNA_COMMIT" | tar -x -C "$src"
    else
        src=$P4C_HEAD_SRC
    fi
    mkdir -p "$deps"
    local abseil protobuf p4runtime inja bdwgc spdlog
    abseil=$(source_dir p4c-head-deps/abseil "${ABSEIL_SRC:-}" https://github.com/abseil/abseil-cpp.git "$ABSEIL_TAG")
    protobuf=$(source_dir p4c-head-deps/protobuf "${PROTOBUF_SRC:-}" https://github.com/protocolbuffers/protobuf.git \
        "$PROTOBUF_TAG")
    p4runtime=$(source_dir p4c-head-deps/p4runtime "" https://github.com/p4lang/p4runtime.git "$HEAD_P4RUNTIME_COMMIT")
    inja=$(source_dir inja "${INJA_SRC:-}" https://github.com/pantor/inja.git "$INJA_COMMIT")
    bdwgc=$(source_dir p4c-head-deps/bdwgc "${BDWGC_SRC:-}" https://github.com/ivmai/bdwgc.git "$BDWGC_COMMIT")
    spdlog=$(source_dir p4c-head-deps/spdlog "${SPDLOG_SRC:-}" https://github.com/gabime/spdlog.git "$SPDLOG_TAG")
    # the Tofino back end's cmake adds spdlog from this fixed path
    rm -rf "$src/backends/tofino/third_party/spdlog" && mkdir -p "$src/backends/tofino/third_party"
    cp -r "$spdlog" "$src/backends/tofino/third_party/spdlog"
    # Patch 1: GCC 12's std::erase_if calls the predicate with a const reference (ir/visitor.cpp).
    sed -i 's/\[this\](flow_join_points_t::value_type &el)/[this](const flow_join_points_t::value_type \&el)/' \
        "$src/ir/visitor.cpp"
    # Patch 2: the bf-p4c driver needs the assembler's path as a string (find_file returns a Path).
    sed -i -E 's/^( +)(bfas|bfrt_schema|p4c_gen_conf) = find_file\((.*)\)$/\1\2 = str(find_file(\3))/' \
        "$src/backends/tofino/bf-p4c/driver/barefoot.py"
    # Python packages the Tofino build runs (logging and schema generators), in a private venv
    [ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
    stage "Python packages for the Tofino build" tofino-venv.log "$venv/bin/pip" install -q "${TOFINO_PY_PACKAGES[@]}"
    log "Tofino back end and P4Testgen (p4c $TNA_COMMIT) in $src/build, into $TOFINO_PREFIX"
    mkdir -p "$src/build"
    stage "Tofino back end" tofino.log env PATH="$venv/bin:$PATH" bash -c "cd '$src/build' && cmake .. \
        -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX='$TOFINO_PREFIX' \
        -DCMAKE_INSTALL_RPATH='$TOFINO_PREFIX/lib' -DCMAKE_UNITY_BUILD=ON -DP4C_DRIVER_NAME=bf-p4c \
        -DENABLE_LTO=OFF -DENABLE_WERROR=OFF -DENABLE_GTESTS=OFF -DENABLE_DOCS=OFF -DENABLE_BMV2=OFF \
        -DENABLE_EBPF=OFF -DENABLE_UBPF=OFF -DENABLE_DPDK=OFF -DENABLE_P4TC=OFF -DENABLE_P4FMT=OFF \
        -DENABLE_P4C_GRAPHS=OFF -DENABLE_P4TEST=OFF -DENABLE_TOFINO=ON -DENABLE_TEST_TOOLS=ON \
        -DENABLE_TOOLS_MODULE_SMITH=OFF -DENABLE_TOOLS_MODULE_TESTGEN=ON -DENABLE_TOOLS_TARGET_BMV2=OFF \
        -DENABLE_TOOLS_TARGET_EBPF=OFF -DENABLE_TOOLS_TARGET_PNA=OFF -DENABLE_TOOLS_TARGET_TOFINO=ON \
        -DUSE_PREINSTALLED_Z3=ON -DZ3_INCLUDE_DIR='$WORK/z3/include' -DZ3_LIBRARY='$PREFIX/lib/libz3.so' \
        -DFETCHCONTENT_FULLY_DISCONNECTED=ON -DFETCHCONTENT_SOURCE_DIR_ABSEIL='$abseil' \
        -DFETCHCONTENT_SOURCE_DIR_PROTOBUF='$protobuf' -DFETCHCONTENT_SOURCE_DIR_P4RUNTIME='$p4runtime' \
        -DFETCHCONTENT_SOURCE_DIR_INJA='$inja' -DFETCHCONTENT_SOURCE_DIR_BDWGC='$bdwgc' \
        && make -j$JOBS && make install && mkdir -p '$TOFINO_PREFIX/lib' && cp -a '$PREFIX/lib/libz3.so' '$TOFINO_PREFIX/lib/'"
    ln -sf "$TOFINO_PREFIX/bin/bf-p4c" "$PREFIX/bin/bf-p4c"
}

main() {
    log "packages"
    stage "installing the distribution's packages" apt.log install_packages
    local pi bmv2 p4c p4runtime
    pi=$(source_dir PI "${PI_SRC:-}" https://github.com/p4lang/PI.git "$PI_TAG")
    bmv2=$(source_dir behavioral-model "${BMV2_SRC:-}" https://github.com/p4lang/behavioral-model.git "$BMV2_TAG")
    p4c=$(source_dir p4c "${P4C_SRC:-}" https://github.com/p4lang/p4c.git "$P4C_TAG")
    p4runtime=$(source_dir p4runtime "${P4RUNTIME_SRC:-}" https://github.com/p4lang/p4runtime.git "$P4RUNTIME_COMMIT")
    build_pi "$pi"
    build_bmv2 "$bmv2"
    build_p4c "$p4c" "$p4runtime"
    install_tna_includes "$p4c"
    if [ "$WITH_TESTGEN" = 1 ]; then
        build_testgen "$p4c" "$p4runtime"
    fi
    if [ "$WITH_TOFINO" = 1 ]; then
        build_tofino "$p4c"
    fi
    log "done: $(command -v simple_switch_grpc) $(command -v p4c-bm2-ss) $(command -v p4test)" \
        "$( [ "$WITH_TESTGEN" = 1 ] && command -v p4testgen)" "$( [ "$WITH_TOFINO" = 1 ] && command -v bf-p4c)"
}

main "$@"
