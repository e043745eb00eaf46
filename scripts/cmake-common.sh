# Sourced by build.sh, sanitize.sh and fuzz.sh: the CMake arguments the builds share, so that one
# checkout's build folders compile each CUDA file once.
#  - ccache (Debian's) as the compiler launcher where it is installed. CCACHE_BASEDIR makes the
#    project's absolute paths relative, so build/ and build-asan/ hash alike.
#  - nvcc's flags identical in both: the sanitized build is RelWithDebInfo, but its CUDA files
#    run no kernel in the CPU tests or the fuzzers, so they take Release's flags, and every build
#    names g++ as nvcc's host compiler (the sanitized build's C++ compiler is clang, which this
#    nvcc does not take). Same command line, same cache entry: the CUDA files, about a quarter
#    of a build's CPU time, compile once instead of twice.
cmake_common_args=(-DCMAKE_CUDA_HOST_COMPILER=g++ -DCMAKE_CUDA_FLAGS_RELWITHDEBINFO="-O3 -DNDEBUG")
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
  cmake_common_args+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
                      -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi

# The sanitized build, build-asan/ (scripts/sanitize.sh runs the CPU tests in it, scripts/fuzz.sh
# the libFuzzer targets): clang, AddressSanitizer and UndefinedBehaviorSanitizer on every host file
# and link (KESTREL_FUZZ), -O1 with assert() and libstdc++'s bounds assertions live, and line
# tables only (a report's stack needs file and line; full debug information made each compile
# slower and the objects twice the size). One build for both saves CI a third compile of the
# host code. nvcc's files compile as in any build (above), unsanitized: the CUDA runtime is not
# instrumented, and neither the CPU tests nor the fuzzers launch kernels. The binaries of GPU
# tests alone and the GPU benchmarks are left out, and so is OpenMP: clang's libomp makes a
# shared-memory file at start, which fails in the tests that cap a program's file size
# (RLIMIT_FSIZE), and the CPU linears' threads are the plain build's to test.
configure_sanitized() {  # configure_sanitized BUILD_DIR
  command -v clang++ >/dev/null || {
    echo "the sanitized build needs clang++ (bash scripts/install-deps.sh --fuzz)" >&2; return 1; }
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90a}" -DKESTREL_FUZZ=ON -DKESTREL_GPU_TESTS=OFF \
    -DCMAKE_DISABLE_FIND_PACKAGE_OpenMP=ON \
    -DKESTREL_TEST_BENCHMARKS=OFF \
    -DCMAKE_CXX_FLAGS="-fno-omit-frame-pointer -D_GLIBCXX_ASSERTIONS" \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" "${cmake_common_args[@]}" > /dev/null
}
