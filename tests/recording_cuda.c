// A stand-in for libcuda.so.1 that records kernel launches instead of running them (tests/launch_record.py builds
// it). Triton's C launchers link against it on a machine without a GPU, so a test can check byte for byte that the
// fast launcher hands the driver what Triton's own launch path does. Every other entry point Triton's launchers
// and cuda_utils call succeeds with plausible values (an sm_90 device); device pointers are taken as they are.
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUfunction;
typedef void *CUmodule;
typedef void *CUstream;
typedef uint64_t CUdeviceptr;

// The fields of CUlaunchConfig / CUlaunchAttribute (cuda.h, CUDA 12 and 13) that a record keeps.
typedef struct {
  int id;
  int pad;
  union {
    char bytes[64];
    int value;
  } value;
} CUlaunchAttribute;

typedef struct {
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  CUstream hStream;
  CUlaunchAttribute *attrs;
  unsigned int numAttrs;
} CUlaunchConfig;

#define MAX_PARAMS 64
#define MAX_BYTES 1024

// What the test sets: the byte size of each kernel parameter, in order (the driver cannot know them).
static int param_count = 0;
static int param_sizes[MAX_PARAMS];

// The last launch: grid, block, shared bytes, stream, function, attributes (id, first int of the value) and the
// parameters' bytes, concatenated.
static unsigned int last_dims[7];
static uint64_t last_stream, last_function;
static int last_attrs[16];
static int last_num_attrs;
static unsigned char last_params[MAX_BYTES];
static int last_params_len;
static int launches = 0;

void record_set_param_sizes(int n, const int *sizes) {
  param_count = n < MAX_PARAMS ? n : MAX_PARAMS;
  memcpy(param_sizes, sizes, sizeof(int) * param_count);
}

int record_launches(void) { return launches; }

int record_last(unsigned int *dims, uint64_t *stream_function, int *attrs, unsigned char *params) {
  memcpy(dims, last_dims, sizeof(last_dims));
  stream_function[0] = last_stream;
  stream_function[1] = last_function;
  memcpy(attrs, last_attrs, sizeof(int) * 2 * last_num_attrs);
  memcpy(params, last_params, last_params_len);
  return last_num_attrs * 1000 + last_params_len;
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) {
  last_dims[0] = config->gridDimX, last_dims[1] = config->gridDimY, last_dims[2] = config->gridDimZ;
  last_dims[3] = config->blockDimX, last_dims[4] = config->blockDimY, last_dims[5] = config->blockDimZ;
  last_dims[6] = config->sharedMemBytes;
  last_stream = (uint64_t)config->hStream;
  last_function = (uint64_t)f;
  last_num_attrs = config->numAttrs < 8 ? config->numAttrs : 8;
  for (int i = 0; i < last_num_attrs; ++i) {
    last_attrs[2 * i] = config->attrs[i].id;
    last_attrs[2 * i + 1] = config->attrs[i].value.value;
  }
  int off = 0;
  for (int i = 0; i < param_count && kernelParams; ++i) {
    if (off + param_sizes[i] > MAX_BYTES) return 1;
    memcpy(last_params + off, kernelParams[i], param_sizes[i]);
    off += param_sizes[i];
  }
  last_params_len = off;
  ++launches;
  return 0;
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                        unsigned int by, unsigned int bz, unsigned int shared, CUstream stream, void **params,
                        void **extra) {
  CUlaunchConfig config = {gx, gy, gz, bx, by, bz, shared, stream, 0, 0};
  return cuLaunchKernelEx(&config, f, params, extra);
}

CUresult cuInit(unsigned int flags) { return 0; }
CUresult cuDriverGetVersion(int *version) { *version = 12080; return 0; }
CUresult cuDeviceGetCount(int *count) { *count = 1; return 0; }
CUresult cuDeviceGet(CUdevice *device, int ordinal) { *device = ordinal; return 0; }

static int primary_context;
CUresult cuCtxGetCurrent(CUcontext *ctx) { *ctx = &primary_context; return 0; }
CUresult cuCtxSetCurrent(CUcontext ctx) { return 0; }
CUresult cuCtxGetDevice(CUdevice *device) { *device = 0; return 0; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) { *ctx = &primary_context; return 0; }
CUresult cuCtxGetLimit(size_t *value, int limit) { *value = 0; return 0; }
CUresult cuCtxSetLimit(int limit, size_t value) { return 0; }

CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
  switch (attribute) {
  case 75: *value = 9; break;           // compute capability major
  case 76: *value = 0; break;           // minor
  case 16: *value = 132; break;         // multiprocessors
  case 10: *value = 32; break;          // warp size
  case 97: case 150: *value = 232448; break;  // opt-in / oversized shared memory per block
  case 12: *value = 65536; break;       // registers per block
  default: *value = 1; break;
  }
  return 0;
}

CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
  *(CUdeviceptr *)data = ptr;
  return 0;
}

CUresult cuPointerGetAttributes(unsigned int n, int *attributes, void **data, CUdeviceptr ptr) { return 0; }

// One function handle per loaded module, so a record names the compiled kernel that ran.
#define MAX_MODULES 4096
static int modules[MAX_MODULES];
static int loaded = 0;
CUresult cuModuleLoadData(CUmodule *module, const void *image) {
  if (loaded == MAX_MODULES) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
  *module = &modules[loaded++];
  return 0;
}
CUresult cuModuleUnload(CUmodule module) { return 0; }
CUresult cuModuleGetFunction(CUfunction *f, CUmodule module, const char *name) { *f = module; return 0; }
CUresult cuFuncGetAttribute(int *value, int attribute, CUfunction f) {
  *value = attribute == 0 ? 1024 : 0;  // CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK; no registers or spills
  return 0;
}
CUresult cuFuncSetAttribute(CUfunction f, int attribute, int value) { return 0; }
CUresult cuFuncSetCacheConfig(CUfunction f, int config) { return 0; }
CUresult cuStreamIsCapturing(CUstream stream, int *status) { *status = 0; return 0; }
CUresult cuOccupancyMaxActiveClusters(int *n, CUfunction f, const void *config) { *n = 1; return 0; }
CUresult cuTensorMapEncodeTiled(void) { return 1; }
CUresult cuTensorMapEncodeIm2col(void) { return 1; }
CUresult cuGetErrorString(CUresult error, const char **str) { *str = "recording_cuda error"; return 0; }
CUresult cuGetErrorName(CUresult error, const char **str) { *str = "RECORDING_CUDA_ERROR"; return 0; }
