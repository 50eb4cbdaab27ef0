/* The subset of ONNX Runtime's C API that the paged-attention custom-op library uses.
 *
 * No package reachable from a build machine ships onnxruntime_c_api.h, so the types and the function
 * table slots used here are declared from the public header in ONNX Runtime's repository
 * (include/onnxruntime/core/session/onnxruntime_c_api.h). The OrtApi struct is a table of function
 * pointers that only ever grows at the end (the header says so: "DO NOT MODIFY ABOVE"); a slot's index
 * is its position in that struct. The library asks OrtGetApiBase()->GetApi(ORT_API_VERSION_USED) for
 * the table, which returns NULL when the loaded runtime is older than that version, and checks the
 * layout once at registration: slot 254 (GetBuildInfoString) must return ONNX Runtime's build-info
 * string. OrtCustomOp is declared in full (its version field tells ONNX Runtime how many of its
 * callbacks exist), every callback is filled.
 */
#ifndef OPTIMIZE_ORT_API_H
#define OPTIMIZE_ORT_API_H

#include <stddef.h>
#include <stdint.h>

/* ONNX Runtime 1.20 (API version 20) has every slot below; pyproject.toml asks for onnxruntime>=1.20. */
#define ORT_API_VERSION_USED 20

typedef struct OrtStatus OrtStatus;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtShapeInferContext OrtShapeInferContext;

typedef enum { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 } OrtErrorCode;

typedef enum {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED = 0,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 = 2,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8 = 3,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 = 6,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 = 7,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 = 16,
} ONNXTensorElementDataType;

typedef enum { INPUT_OUTPUT_REQUIRED = 0, INPUT_OUTPUT_OPTIONAL = 1, INPUT_OUTPUT_VARIADIC = 2 }
    OrtCustomOpInputOutputCharacteristic;

typedef enum { OrtMemTypeDefault = 0 } OrtMemType;

/* OrtApi slots (index = position in struct OrtApi). */
enum {
    ORT_SLOT_CreateStatus = 0,
    ORT_SLOT_GetErrorMessage = 2,
    ORT_SLOT_CreateCustomOpDomain = 26,
    ORT_SLOT_CustomOpDomain_Add = 27,
    ORT_SLOT_AddCustomOpDomain = 28,
    ORT_SLOT_GetTensorMutableData = 51,
    ORT_SLOT_GetTensorElementType = 60,
    ORT_SLOT_GetDimensionsCount = 61,
    ORT_SLOT_GetDimensions = 62,
    ORT_SLOT_GetTensorTypeAndShape = 65,
    ORT_SLOT_KernelInfoGetAttribute_float = 85,
    ORT_SLOT_KernelInfoGetAttribute_int64 = 86,
    ORT_SLOT_KernelContext_GetInputCount = 88,
    ORT_SLOT_KernelContext_GetInput = 90,
    ORT_SLOT_KernelContext_GetOutput = 91,
    ORT_SLOT_ReleaseStatus = 93,
    ORT_SLOT_ReleaseTensorTypeAndShapeInfo = 99,
    ORT_SLOT_ReleaseCustomOpDomain = 101,
    ORT_SLOT_GetBuildInfoString = 254,
    ORT_SLOT_KernelContext_ParallelFor = 274,
};

typedef void (*OrtApiFn)(void);
typedef struct OrtApi OrtApi; /* opaque: accessed as an array of function pointers through ORT_FN */

typedef struct OrtApiBase {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

#define ORT_FN(api, slot, type) ((type)(((const OrtApiFn *)(api))[ORT_SLOT_##slot]))

typedef OrtStatus *(*OrtCreateStatusFn)(OrtErrorCode code, const char *msg);
typedef const char *(*OrtGetErrorMessageFn)(const OrtStatus *status);
typedef OrtStatus *(*OrtCreateCustomOpDomainFn)(const char *domain, OrtCustomOpDomain **out);
typedef OrtStatus *(*OrtCustomOpDomainAddFn)(OrtCustomOpDomain *domain, const void *op);
typedef OrtStatus *(*OrtAddCustomOpDomainFn)(OrtSessionOptions *options, OrtCustomOpDomain *domain);
typedef OrtStatus *(*OrtGetTensorMutableDataFn)(OrtValue *value, void **out);
typedef OrtStatus *(*OrtGetTensorElementTypeFn)(const OrtTensorTypeAndShapeInfo *info,
                                                ONNXTensorElementDataType *out);
typedef OrtStatus *(*OrtGetDimensionsCountFn)(const OrtTensorTypeAndShapeInfo *info, size_t *out);
typedef OrtStatus *(*OrtGetDimensionsFn)(const OrtTensorTypeAndShapeInfo *info, int64_t *dims, size_t n);
typedef OrtStatus *(*OrtGetTensorTypeAndShapeFn)(const OrtValue *value, OrtTensorTypeAndShapeInfo **out);
typedef OrtStatus *(*OrtKernelInfoGetAttributeFloatFn)(const OrtKernelInfo *info, const char *name, float *out);
typedef OrtStatus *(*OrtKernelInfoGetAttributeInt64Fn)(const OrtKernelInfo *info, const char *name, int64_t *out);
typedef OrtStatus *(*OrtKernelContextGetInputCountFn)(const OrtKernelContext *ctx, size_t *out);
typedef OrtStatus *(*OrtKernelContextGetInputFn)(const OrtKernelContext *ctx, size_t index, const OrtValue **out);
typedef OrtStatus *(*OrtKernelContextGetOutputFn)(OrtKernelContext *ctx, size_t index, const int64_t *dims,
                                                  size_t n, OrtValue **out);
typedef void (*OrtReleaseStatusFn)(OrtStatus *status);
typedef void (*OrtReleaseTensorTypeAndShapeInfoFn)(OrtTensorTypeAndShapeInfo *info);
typedef void (*OrtReleaseCustomOpDomainFn)(OrtCustomOpDomain *domain);
typedef const char *(*OrtGetBuildInfoStringFn)(void);
typedef OrtStatus *(*OrtKernelContextParallelForFn)(const OrtKernelContext *ctx, void (*fn)(void *, size_t),
                                                    size_t total, size_t num_batch, void *usr_data);

/* struct OrtCustomOp, every field of API version 20 in declaration order. */
typedef struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const struct OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info);
    const char *(*GetName)(const struct OrtCustomOp *op);
    const char *(*GetExecutionProviderType)(const struct OrtCustomOp *op);
    ONNXTensorElementDataType (*GetInputType)(const struct OrtCustomOp *op, size_t index);
    size_t (*GetInputTypeCount)(const struct OrtCustomOp *op);
    ONNXTensorElementDataType (*GetOutputType)(const struct OrtCustomOp *op, size_t index);
    size_t (*GetOutputTypeCount)(const struct OrtCustomOp *op);
    void (*KernelCompute)(void *op_kernel, OrtKernelContext *context);
    void (*KernelDestroy)(void *op_kernel);
    OrtCustomOpInputOutputCharacteristic (*GetInputCharacteristic)(const struct OrtCustomOp *op, size_t index);
    OrtCustomOpInputOutputCharacteristic (*GetOutputCharacteristic)(const struct OrtCustomOp *op, size_t index);
    OrtMemType (*GetInputMemoryType)(const struct OrtCustomOp *op, size_t index);
    int (*GetVariadicInputMinArity)(const struct OrtCustomOp *op);
    int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp *op);
    int (*GetVariadicOutputMinArity)(const struct OrtCustomOp *op);
    int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp *op);
    OrtStatus *(*CreateKernelV2)(const struct OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                 void **kernel);
    OrtStatus *(*KernelComputeV2)(void *op_kernel, OrtKernelContext *context);
    OrtStatus *(*InferOutputShapeFn)(const struct OrtCustomOp *op, OrtShapeInferContext *ctx);
    int (*GetStartVersion)(const struct OrtCustomOp *op);
    int (*GetEndVersion)(const struct OrtCustomOp *op);
    size_t (*GetMayInplace)(int **input_index, int **output_index);
    void (*ReleaseMayInplace)(int *input_index, int *output_index);
    size_t (*GetAliasMap)(int **input_index, int **output_index);
    void (*ReleaseAliasMap)(int *input_index, int *output_index);
} OrtCustomOp;

#endif /* OPTIMIZE_ORT_API_H */
