// Does compute-sanitizer initcheck see what cuBLASLt writes? C is written only by the GEMM (every
// algorithm the heuristic offers, each into fresh memory), then read by a kernel. On the H200 with
// CUDA 13 initcheck reports every element of C as uninitialized: its writes are invisible to the
// tool, so scripts/gpu-sanitize.sh keeps initcheck to runs that read no GEMM output.
//   nvcc -arch=sm_90a -o probe scripts/initcheck-cublaslt.cu -lcublasLt
//   compute-sanitizer --tool initcheck ./probe
#include <cublasLt.h>
#include <cuda_fp16.h>
#include <cstdio>
__global__ void read_all(const __half* c, int n, float* out) {
  float s = 0; for (int i = threadIdx.x; i < n; i += blockDim.x) s += __half2float(c[i]);
  atomicAdd(out, s);
}
int main() {
  const int M = 6, N = 768, K = 256;
  __half *A, *B, *C; float* out; void* ws; size_t wsb = 32 << 20;
  cudaMalloc(&A, M * K * 2); cudaMalloc(&B, N * K * 2); cudaMalloc(&C, M * N * 2);
  cudaMalloc(&out, 4); cudaMalloc(&ws, wsb);
  cudaMemset(A, 0, M * K * 2); cudaMemset(B, 0, N * K * 2); cudaMemset(out, 0, 4);
  cublasLtHandle_t h; cublasLtCreate(&h);
  cublasLtMatmulDesc_t d; cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
  // column-major: C^T [N, M] = W [N,K] (as K x N transposed) * x^T [K, M]
  cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t);
  cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof n);
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatrixLayoutCreate(&la, CUDA_R_16F, K, N, K);
  cublasLtMatrixLayoutCreate(&lb, CUDA_R_16F, K, M, K);
  cublasLtMatrixLayoutCreate(&lc, CUDA_R_16F, N, M, N);
  cublasLtMatmulPreference_t p; cublasLtMatmulPreferenceCreate(&p);
  cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb);
  cublasLtMatmulHeuristicResult_t r[8]; int got = 0;
  cublasLtMatmulAlgoGetHeuristic(h, d, la, lb, lc, lc, p, 8, r, &got);
  float one = 1, zero = 0;
  for (int i = 0; i < got; ++i) {
    cudaMemset(out, 0, 4);
    int st = cublasLtMatmul(h, d, &one, B, la, A, lb, &zero, C, lc, C, lc, &r[i].algo, ws, wsb, 0);
    read_all<<<1, 256>>>(C, M * N, out);
    cudaDeviceSynchronize();
    printf("algo %d status %d err %s\n", i, st, cudaGetErrorString(cudaGetLastError()));
    cudaFree(C); cudaMalloc(&C, M * N * 2);  // fresh, uninitialized memory for the next algorithm
  }
  return 0;
}
