/*
 * convkit.h: the C ABI of convkit, specialised CPU convolution kernels.
 *
 * Kept by hand beside src/capi.rs; tests/capi.rs proves they agree (every function declared
 * here, struct sizes, field offsets and constants checked by _Static_assert, and the C test
 * tests/c/capi_test.c calling every function against a convolution computed in C).
 *
 * Build the library with the `capi` feature:
 *     cargo build --release --features capi
 * which writes target/release/libconvkit.a and libconvkit.so. Link the static library with
 *     cc app.c -Iinclude target/release/libconvkit.a -lpthread -ldl -lm
 *
 * Three phases, as in XNNPACK:
 *   create  convkit_conv_create: validates, chooses the algorithm, packs the weights once;
 *   plan    convkit_conv_plan: fixes the input size (output shape, workspace size);
 *   run     convkit_plan_run: checks lengths and runs; allocates nothing once the workspace
 *           holds the plan's workspace_bytes. Share one workspace across every layer.
 *
 * Semantics are PyTorch's / ONNX's: cross-correlation, OIHW weights with
 * I = in_channels / groups, NCHW or NHWC activations. Every function that can fail returns a
 * convkit_status; convkit_last_error_message() then says what is wrong, with the values. NULL
 * pointers, bad enum values, wrong lengths, misaligned or overlapping tensors are errors,
 * never undefined behaviour; a panic inside convkit (a bug) is CONVKIT_ERROR_PANIC.
 *
 * Threads: convolutions and plans are immutable and may be used from many threads at once;
 * a workspace serves one run at a time. convkit_last_error_message is per thread.
 */
#ifndef CONVKIT_H
#define CONVKIT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI version this header describes; compare with convkit_abi_version(). */
#define CONVKIT_ABI_VERSION 1

/* ---- Status codes --------------------------------------------------------------------- */

typedef int32_t convkit_status;

enum {
    CONVKIT_OK = 0,
    CONVKIT_ERROR_ZERO = 1,                    /* a size or step that must be >= 1 was 0 */
    CONVKIT_ERROR_NOT_DIVISIBLE_BY_GROUPS = 2, /* channels not a multiple of groups */
    CONVKIT_ERROR_KERNEL_TOO_LARGE = 3,        /* dilated kernel larger than padded input */
    CONVKIT_ERROR_OVERFLOW = 4,                /* a product of sizes overflows */
    CONVKIT_ERROR_WRONG_LENGTH = 5,            /* a tensor has the wrong number of elements */
    CONVKIT_ERROR_INVALID_PARAMETER = 6,       /* bad value, enum, alignment or overlap */
    CONVKIT_ERROR_OUT_OF_MEMORY = 7,
    CONVKIT_ERROR_ISA_UNAVAILABLE = 8,         /* the CPU lacks it, or the build left it out */
    CONVKIT_ERROR_ALGORITHM_UNSUPPORTED = 9,   /* the forced algorithm does not take it */
    CONVKIT_ERROR_NO_GPU = 10,                 /* (GPU path; not returned by this ABI) */
    CONVKIT_ERROR_GPU = 11,                    /* (GPU path; not returned by this ABI) */
    CONVKIT_ERROR_NULL_POINTER = 12,           /* a pointer that must not be NULL was NULL */
    CONVKIT_ERROR_NOT_BUILT = 13,              /* the library was built without the feature */
    CONVKIT_ERROR_PANIC = 14                   /* a bug inside convkit; please report it */
};

/* ---- Enumerations (int32_t fields of the structs below) ------------------------------- */

enum { /* convkit_conv_params.padding */
    CONVKIT_PADDING_EXPLICIT = 0,   /* pad_top, pad_bottom, pad_left, pad_right */
    CONVKIT_PADDING_SAME = 1,       /* ONNX SAME_UPPER: output = ceil(input / stride) */
    CONVKIT_PADDING_SAME_LOWER = 2, /* ONNX SAME_LOWER */
    CONVKIT_PADDING_VALID = 3       /* no padding */
};

enum { /* convkit_conv_params.layout (weights are always OIHW) */
    CONVKIT_LAYOUT_NCHW = 0,
    CONVKIT_LAYOUT_NHWC = 1
};

enum { /* convkit_conv_params.activation, applied after bias and residual */
    CONVKIT_ACTIVATION_NONE = 0,
    CONVKIT_ACTIVATION_RELU = 1,
    CONVKIT_ACTIVATION_RELU6 = 2,
    CONVKIT_ACTIVATION_CLAMP = 3,      /* min(max(x, activation_min), activation_max) */
    CONVKIT_ACTIVATION_LEAKY_RELU = 4, /* x > 0 ? x : activation_alpha * x */
    CONVKIT_ACTIVATION_SILU = 5,
    CONVKIT_ACTIVATION_GELU = 6,       /* exact (erf) */
    CONVKIT_ACTIVATION_HARD_SWISH = 7,
    CONVKIT_ACTIVATION_SIGMOID = 8
};

enum { /* convkit_options.isa: never above what the CPU has */
    CONVKIT_ISA_AUTO = 0, /* the best level (or the CONVKIT_ISA environment variable) */
    CONVKIT_ISA_SCALAR = 1,
    CONVKIT_ISA_AVX2 = 2,
    CONVKIT_ISA_AVX512 = 3,
    CONVKIT_ISA_NEON = 4
};

enum { /* convkit_options.precision */
    CONVKIT_PRECISION_BALANCED = 0, /* Winograd with every tile where fastest (within 1e-4) */
    CONVKIT_PRECISION_ACCURATE = 1, /* Winograd F(2,3) and F(4,3) only (within 4e-5) */
    CONVKIT_PRECISION_EXACT = 2     /* never Winograd */
};

enum { /* convkit_options.algorithm */
    CONVKIT_ALGORITHM_AUTO = 0,
    CONVKIT_ALGORITHM_IM2COL_GEMM = 1,
    CONVKIT_ALGORITHM_DEPTHWISE = 2,
    CONVKIT_ALGORITHM_DEPTHWISE_GENERIC = 3,
    CONVKIT_ALGORITHM_DIRECT = 4,
    CONVKIT_ALGORITHM_WINOGRAD = 5
};

enum { /* convkit_quant_params.input_type and output_type */
    CONVKIT_QTYPE_U8 = 0,
    CONVKIT_QTYPE_I8 = 1,
    CONVKIT_QTYPE_I32 = 2, /* output only: the int32 sums plus bias */
    CONVKIT_QTYPE_F32 = 3  /* output only: dequantised, then the activation and residual */
};

/* ---- Structs -------------------------------------------------------------------------- */

/* A convolution's parameters. Fill with convkit_conv_params_init, then change what differs. */
typedef struct convkit_conv_params {
    size_t in_channels;
    size_t out_channels;
    size_t groups;        /* 1 = dense; in_channels = depthwise (any channel multiplier) */
    size_t kernel_h;      /* 1 for a 1-D convolution */
    size_t kernel_w;
    size_t stride_h;
    size_t stride_w;
    size_t dilation_h;
    size_t dilation_w;
    size_t pad_top;       /* CONVKIT_PADDING_EXPLICIT only */
    size_t pad_bottom;
    size_t pad_left;
    size_t pad_right;
    int32_t padding;      /* CONVKIT_PADDING_* */
    int32_t layout;       /* CONVKIT_LAYOUT_* */
    int32_t activation;   /* CONVKIT_ACTIVATION_* */
    float activation_min; /* CLAMP */
    float activation_max; /* CLAMP */
    float activation_alpha; /* LEAKY_RELU */
} convkit_conv_params;

/* How a convolution runs. All zeros, or a NULL pointer, is the default. */
typedef struct convkit_options {
    size_t threads;    /* 0: the whole pool (1 without the threads feature); 1: the caller's
                          thread only; n: at most n workers */
    int32_t isa;       /* CONVKIT_ISA_* */
    int32_t precision; /* CONVKIT_PRECISION_* */
    int32_t algorithm; /* CONVKIT_ALGORITHM_* */
} convkit_options;

/* The quantization of an int8 convolution (ONNX QLinearConv). */
typedef struct convkit_quant_params {
    int32_t input_type;          /* CONVKIT_QTYPE_U8 or CONVKIT_QTYPE_I8 */
    int32_t input_zero_point;
    float input_scale;
    const float *weight_scales;  /* 1 (per tensor) or out_channels (per channel); the
                                    weights are symmetric (zero point 0) */
    size_t weight_scales_len;
    int32_t output_type;         /* CONVKIT_QTYPE_* */
    int32_t output_zero_point;   /* u8 and i8 outputs */
    float output_scale;          /* u8 and i8 outputs */
} convkit_quant_params;

/* What a plan fixed. Lengths are in elements. */
typedef struct convkit_plan_info {
    size_t output_shape[4]; /* in the layout's order: N,C,H,W or N,H,W,C */
    size_t input_len;
    size_t output_len;      /* also the residual's */
    size_t workspace_bytes;
    size_t pads[4];         /* the padding resolved for this size: top, bottom, left, right */
    double flops;           /* direct-convolution operations, 2 per multiply-add */
} convkit_plan_info;

/* Opaque handles. */
typedef struct convkit_conv convkit_conv;           /* an f32 convolution, weights packed */
typedef struct convkit_plan convkit_plan;           /* an f32 convolution at one input size */
typedef struct convkit_qconv convkit_qconv;         /* an int8 convolution, weights packed */
typedef struct convkit_qplan convkit_qplan;         /* an int8 convolution at one input size */
typedef struct convkit_workspace convkit_workspace; /* scratch memory, grows only */

/* ---- Library -------------------------------------------------------------------------- */

/* The library's version, e.g. "0.1.0" (static). */
const char *convkit_version(void);
/* The library's CONVKIT_ABI_VERSION. */
uint32_t convkit_abi_version(void);
/* The calling thread's last failure, with the values ("" if none); valid until that
   thread's next failing call. */
const char *convkit_last_error_message(void);
/* "CONVKIT_ERROR_WRONG_LENGTH" etc. (static; "CONVKIT_UNKNOWN_STATUS" for other values). */
const char *convkit_status_name(convkit_status status);
/* The best CONVKIT_ISA_* this CPU has and this build has kernels for. */
int32_t convkit_best_isa(void);
/* A dense in -> out convolution with a kernel_h x kernel_w kernel: groups 1, stride 1,
   dilation 1, explicit zero padding, NCHW, no activation. */
convkit_status convkit_conv_params_init(convkit_conv_params *params, size_t in_channels,
                                        size_t out_channels, size_t kernel_h, size_t kernel_w);

/* ---- Workspaces ----------------------------------------------------------------------- */

/* A workspace of at least `bytes` (0: empty; runs grow it to what they need). */
convkit_status convkit_workspace_create(size_t bytes, convkit_workspace **out);
convkit_status convkit_workspace_reserve(convkit_workspace *workspace, size_t bytes);
size_t convkit_workspace_bytes(const convkit_workspace *workspace); /* 0 for NULL */
void convkit_workspace_destroy(convkit_workspace *workspace);       /* NULL: nothing */

/* ---- f32 convolutions ----------------------------------------------------------------- */

/* weights: OIHW, out x in/groups x kh x kw floats; bias: out_channels floats, or NULL and 0.
   Both are copied. options may be NULL. */
convkit_status convkit_conv_create(const convkit_conv_params *params, const float *weights,
                                   size_t weights_len, const float *bias, size_t bias_len,
                                   const convkit_options *options, convkit_conv **out);
/* 1-D: kernel_h, stride_h, dilation_h 1 and no vertical padding; plan with in_h = 1. */
convkit_status convkit_conv1d_create(const convkit_conv_params *params, const float *weights,
                                     size_t weights_len, const float *bias, size_t bias_len,
                                     const convkit_options *options, convkit_conv **out);
/* "im2col_gemm", "depthwise", "depthwise_generic", "direct" or "winograd" (static). */
const char *convkit_conv_algorithm(const convkit_conv *conv);
void convkit_conv_destroy(convkit_conv *conv); /* plans made from it stay valid */

convkit_status convkit_conv_plan(const convkit_conv *conv, size_t batch, size_t in_h,
                                 size_t in_w, convkit_plan **out);
convkit_status convkit_plan_get_info(const convkit_plan *plan, convkit_plan_info *info);
/* e.g. "im2col_gemm/gemm_f32_6x16_avx2"; valid while the plan lives. */
const char *convkit_plan_kernel_name(const convkit_plan *plan);
/* output = act(conv(input) + bias). Lengths in floats; output must not overlap input.
   workspace may be NULL (the run then allocates its scratch). */
convkit_status convkit_plan_run(const convkit_plan *plan, const float *input,
                                size_t input_len, float *output, size_t output_len,
                                convkit_workspace *workspace);
/* output = act(conv(input) + bias + residual), residual of the output's shape. */
convkit_status convkit_plan_run_residual(const convkit_plan *plan, const float *input,
                                         size_t input_len, const float *residual,
                                         size_t residual_len, float *output,
                                         size_t output_len, convkit_workspace *workspace);
void convkit_plan_destroy(convkit_plan *plan);

/* ---- int8 convolutions (CONVKIT_ERROR_NOT_BUILT without the int8 feature) -------------- */

/* weights: OIHW int8; bias: out_channels int32 in units of input_scale * weight_scale, or
   NULL and 0. A fused activation other than ReLU, ReLU6 or clamp needs an f32 output. */
convkit_status convkit_qconv_create(const convkit_conv_params *params,
                                    const convkit_quant_params *quant, const int8_t *weights,
                                    size_t weights_len, const int32_t *bias, size_t bias_len,
                                    const convkit_options *options, convkit_qconv **out);
convkit_status convkit_qconv1d_create(const convkit_conv_params *params,
                                      const convkit_quant_params *quant,
                                      const int8_t *weights, size_t weights_len,
                                      const int32_t *bias, size_t bias_len,
                                      const convkit_options *options, convkit_qconv **out);
void convkit_qconv_destroy(convkit_qconv *conv);

convkit_status convkit_qconv_plan(const convkit_qconv *conv, size_t batch, size_t in_h,
                                  size_t in_w, convkit_qplan **out);
convkit_status convkit_qplan_get_info(const convkit_qplan *plan, convkit_plan_info *info);
const char *convkit_qplan_kernel_name(const convkit_qplan *plan);
/* input: input_len elements of the input type (uint8_t or int8_t); output: output_len of
   the output type (uint8_t, int8_t, int32_t or float). */
convkit_status convkit_qplan_run(const convkit_qplan *plan, const void *input,
                                 size_t input_len, void *output, size_t output_len,
                                 convkit_workspace *workspace);
/* CONVKIT_QTYPE_F32 outputs only. */
convkit_status convkit_qplan_run_residual(const convkit_qplan *plan, const void *input,
                                          size_t input_len, const float *residual,
                                          size_t residual_len, float *output,
                                          size_t output_len, convkit_workspace *workspace);
void convkit_qplan_destroy(convkit_qplan *plan);

#ifdef __cplusplus
}
#endif

#endif /* CONVKIT_H */
