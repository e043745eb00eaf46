# Sourced by build.sh, sanitize.sh and fuzz.sh: the CMake arguments the three builds share, so
# that one checkout's three build folders compile each CUDA file once.
#  - ccache (Debian's) as the compiler launcher where it is installed. CCACHE_BASEDIR makes the
#    project's absolute paths relative, so build/, build-asan/ and build-fuzz/ hash alike.
#  - nvcc's flags identical in all three: the sanitized and fuzzing builds are RelWithDebInfo,
#    but their CUDA files run no kernel in the CPU tests or the fuzzers, so they take Release's
#    flags, and every build names g++ as nvcc's host compiler (the fuzzing build's C++ compiler
#    is clang, which this nvcc does not take). Same command line, same cache entry: the CUDA
#    files, about a quarter of a build's CPU time, compile once instead of three times.
cmake_common_args=(-DCMAKE_CUDA_HOST_COMPILER=g++ -DCMAKE_CUDA_FLAGS_RELWITHDEBINFO="-O3 -DNDEBUG")
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
  cmake_common_args+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
                      -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
