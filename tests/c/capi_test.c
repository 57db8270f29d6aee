/*
 * The C ABI's test: includes convkit.h, calls every function it declares, and checks the
 * results against convolutions computed here from the definition (PyTorch/ONNX semantics).
 * Built and run by tests/capi.rs, which also passes the ABI checks generated from the Rust
 * side (CONVKIT_ABI_CHECK: struct sizes, field offsets, constants) and the crate's version.
 * Exits 0 when every check passes; prints each failure.
 */
#include "convkit.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef CONVKIT_ABI_CHECK
#include CONVKIT_ABI_CHECK
#endif

static int failures = 0;

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            failures++;                                                                    \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);        \
            fprintf(stderr, __VA_ARGS__);                                                  \
            fprintf(stderr, "\n");                                                         \
        }                                                                                  \
    } while (0)

/* Expects `call` to return CONVKIT_OK; else prints the status and the last error. */
#define OK(call)                                                                           \
    do {                                                                                   \
        convkit_status s_ = (call);                                                        \
        CHECK(s_ == CONVKIT_OK, "%s: %s", convkit_status_name(s_),                        \
              convkit_last_error_message());                                               \
    } while (0)

/* Expects `call` to fail with `want`, and a non-empty message. */
#define FAILS(want, call)                                                                  \
    do {                                                                                   \
        convkit_status s_ = (call);                                                        \
        CHECK(s_ == (want), "got %s, want %s", convkit_status_name(s_),                    \
              convkit_status_name(want));                                                  \
        CHECK(strlen(convkit_last_error_message()) > 0, "empty error message");            \
    } while (0)

/* A deterministic generator, uniform in [-1, 1). */
static uint64_t rng_state = 0x1234567;
static float uniform(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) & 0xffffff) / (float)(1 << 23) - 1.0f;
}
static float *random_floats(size_t n) {
    float *v = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = uniform();
    return v;
}

static float activate(const convkit_conv_params *p, float x) {
    switch (p->activation) {
    case CONVKIT_ACTIVATION_RELU: return x > 0 ? x : 0;
    case CONVKIT_ACTIVATION_RELU6: return x < 0 ? 0 : (x > 6 ? 6 : x);
    case CONVKIT_ACTIVATION_CLAMP:
        return x < p->activation_min ? p->activation_min
                                     : (x > p->activation_max ? p->activation_max : x);
    case CONVKIT_ACTIVATION_LEAKY_RELU: return x > 0 ? x : p->activation_alpha * x;
    case CONVKIT_ACTIVATION_SILU: return x / (1.0f + expf(-x));
    case CONVKIT_ACTIVATION_SIGMOID: return 1.0f / (1.0f + expf(-x));
    default: return x;
    }
}

/* Index of (n, c, y, x) in a tensor of c_all channels, h x w, in the params' layout. */
static size_t at(const convkit_conv_params *p, size_t n, size_t c, size_t y, size_t x,
                 size_t c_all, size_t h, size_t w) {
    if (p->layout == CONVKIT_LAYOUT_NHWC) return ((n * h + y) * w + x) * c_all + c;
    return ((n * c_all + c) * h + y) * w + x;
}

/* The definition: the sum over each group's input channels and taps (zero outside the
   image, `pads` top/bottom/left/right), in double, then bias, residual, activation. */
static void reference(const convkit_conv_params *p, size_t batch, size_t h, size_t w,
                      const size_t pads[4], size_t oh, size_t ow, const float *x,
                      const float *wt, const float *bias, const float *residual, float *y) {
    size_t cin_g = p->in_channels / p->groups, cout_g = p->out_channels / p->groups;
    for (size_t n = 0; n < batch; n++)
        for (size_t co = 0; co < p->out_channels; co++)
            for (size_t oy = 0; oy < oh; oy++)
                for (size_t ox = 0; ox < ow; ox++) {
                    size_t g = co / cout_g;
                    double sum = bias ? bias[co] : 0.0;
                    for (size_t ci = 0; ci < cin_g; ci++)
                        for (size_t ky = 0; ky < p->kernel_h; ky++)
                            for (size_t kx = 0; kx < p->kernel_w; kx++) {
                                long iy = (long)(oy * p->stride_h + ky * p->dilation_h) -
                                          (long)pads[0];
                                long ix = (long)(ox * p->stride_w + kx * p->dilation_w) -
                                          (long)pads[2];
                                if (iy < 0 || ix < 0 || iy >= (long)h || ix >= (long)w)
                                    continue;
                                float xv = x[at(p, n, g * cin_g + ci, (size_t)iy, (size_t)ix,
                                                p->in_channels, h, w)];
                                float wv = wt[((co * cin_g + ci) * p->kernel_h + ky) *
                                                  p->kernel_w + kx];
                                sum += (double)xv * wv;
                            }
                    size_t o = at(p, n, co, oy, ox, p->out_channels, oh, ow);
                    if (residual) sum += residual[o];
                    y[o] = activate(p, (float)sum);
                }
}

/* Creates, plans and runs `p` on random data (1-D through convkit_conv1d_create when
   `one_d`), and compares every output with the definition. */
static void check_conv(const char *name, const convkit_conv_params *p,
                       const convkit_options *options, size_t batch, size_t h, size_t w,
                       int with_bias, int with_residual, int one_d,
                       convkit_workspace *workspace) {
    size_t wlen = p->out_channels * (p->in_channels / p->groups) * p->kernel_h * p->kernel_w;
    float *wt = random_floats(wlen);
    float *bias = with_bias ? random_floats(p->out_channels) : NULL;
    convkit_conv *conv = NULL;
    convkit_plan *plan = NULL;
    if (one_d)
        OK(convkit_conv1d_create(p, wt, wlen, bias, with_bias ? p->out_channels : 0, options,
                                 &conv));
    else
        OK(convkit_conv_create(p, wt, wlen, bias, with_bias ? p->out_channels : 0, options,
                               &conv));
    if (!conv) goto done;
    OK(convkit_conv_plan(conv, batch, h, w, &plan));
    if (!plan) goto done;
    convkit_plan_info info;
    OK(convkit_plan_get_info(plan, &info));
    size_t oh, ow;
    if (p->layout == CONVKIT_LAYOUT_NHWC) {
        CHECK(info.output_shape[3] == p->out_channels, "%s: channels", name);
        oh = info.output_shape[1];
        ow = info.output_shape[2];
    } else {
        CHECK(info.output_shape[1] == p->out_channels, "%s: channels", name);
        oh = info.output_shape[2];
        ow = info.output_shape[3];
    }
    CHECK(info.output_shape[0] == batch, "%s: batch", name);
    CHECK(info.input_len == batch * p->in_channels * h * w, "%s: input_len", name);
    CHECK(info.output_len == batch * p->out_channels * oh * ow, "%s: output_len", name);
    CHECK(info.flops > 0, "%s: flops", name);
    /* The output size from the resolved padding, as the definition says. */
    size_t span_h = (p->kernel_h - 1) * p->dilation_h + 1;
    size_t span_w = (p->kernel_w - 1) * p->dilation_w + 1;
    CHECK(oh == (h + info.pads[0] + info.pads[1] - span_h) / p->stride_h + 1, "%s: oh", name);
    CHECK(ow == (w + info.pads[2] + info.pads[3] - span_w) / p->stride_w + 1, "%s: ow", name);

    float *x = random_floats(info.input_len);
    float *res = with_residual ? random_floats(info.output_len) : NULL;
    float *y = malloc(info.output_len * sizeof(float));
    float *want = malloc(info.output_len * sizeof(float));
    for (size_t i = 0; i < info.output_len; i++) y[i] = NAN; /* every output must be written */
    if (with_residual)
        OK(convkit_plan_run_residual(plan, x, info.input_len, res, info.output_len, y,
                                     info.output_len, workspace));
    else
        OK(convkit_plan_run(plan, x, info.input_len, y, info.output_len, workspace));
    if (workspace)
        CHECK(convkit_workspace_bytes(workspace) >= info.workspace_bytes, "%s: workspace grew",
              name);
    reference(p, batch, h, w, info.pads, oh, ow, x, wt, bias, res, want);
    size_t bad = 0;
    float worst = 0;
    for (size_t i = 0; i < info.output_len; i++) {
        float err = fabsf(y[i] - want[i]);
        if (!(err <= 1e-3f * (1.0f + fabsf(want[i])))) bad++;
        if (!(err <= worst)) worst = err;
    }
    CHECK(bad == 0, "%s (%s): %zu of %zu outputs differ from the definition (worst %g)", name,
          convkit_plan_kernel_name(plan), bad, info.output_len, (double)worst);
    printf("ok  %-32s %-48s %zu outputs, max error %.2g\n", name,
           convkit_plan_kernel_name(plan), info.output_len, (double)worst);
    free(x);
    free(res);
    free(y);
    free(want);
done:
    convkit_plan_destroy(plan);
    convkit_conv_destroy(conv);
    free(wt);
    free(bias);
}

/* The definition of a quantized convolution's requantised u8 output (convkit's rounding:
   the exact int32 sum times the f32 multiplier, in f32, rounded half to even). */
static void check_int8(convkit_workspace *workspace) {
    convkit_conv_params p;
    OK(convkit_conv_params_init(&p, 8, 16, 3, 3));
    p.padding = CONVKIT_PADDING_SAME;
    p.activation = CONVKIT_ACTIVATION_RELU;
    const size_t h = 9, w = 7, wlen = 16 * 8 * 9;
    float wscale = 0.01f;
    convkit_quant_params q = {CONVKIT_QTYPE_U8, 120, 0.02f, &wscale, 1, CONVKIT_QTYPE_U8,
                              100, 0.05f};
    int8_t *wt = malloc(wlen);
    int32_t bias[16];
    for (size_t i = 0; i < wlen; i++) wt[i] = (int8_t)((int)(uniform() * 127.0f));
    for (size_t i = 0; i < 16; i++) bias[i] = (int32_t)(uniform() * 2000.0f);
    convkit_qconv *conv = NULL;
    convkit_qplan *plan = NULL;
    convkit_status s = convkit_qconv_create(&p, &q, wt, wlen, bias, 16, NULL, &conv);
    if (s == CONVKIT_ERROR_NOT_BUILT) {
        printf("--  int8: not built (%s)\n", convkit_last_error_message());
        free(wt);
        return;
    }
    CHECK(s == CONVKIT_OK, "qconv_create: %s", convkit_last_error_message());
    if (!conv) goto done;
    OK(convkit_qconv_plan(conv, 1, h, w, &plan));
    if (!plan) goto done;
    convkit_plan_info info;
    OK(convkit_qplan_get_info(plan, &info));
    CHECK(info.output_len == 16 * h * w, "int8 output_len %zu", info.output_len);
    uint8_t *x = malloc(info.input_len);
    uint8_t *y = malloc(info.output_len);
    for (size_t i = 0; i < info.input_len; i++) {
        uniform();
        x[i] = (uint8_t)(rng_state >> 56);
    }
    OK(convkit_qplan_run(plan, x, info.input_len, y, info.output_len, workspace));
    float mult = (float)((double)q.input_scale * wscale / q.output_scale);
    size_t bad = 0;
    for (size_t co = 0; co < 16; co++)
        for (size_t oy = 0; oy < h; oy++)
            for (size_t ox = 0; ox < w; ox++) {
                long long sum = bias[co];
                for (size_t ci = 0; ci < 8; ci++)
                    for (size_t ky = 0; ky < 3; ky++)
                        for (size_t kx = 0; kx < 3; kx++) {
                            long iy = (long)(oy + ky) - (long)info.pads[0];
                            long ix = (long)(ox + kx) - (long)info.pads[2];
                            if (iy < 0 || ix < 0 || iy >= (long)h || ix >= (long)w) continue;
                            int xv = x[(ci * h + (size_t)iy) * w + (size_t)ix];
                            sum += (long long)(xv - q.input_zero_point) *
                                   wt[((co * 8 + ci) * 3 + ky) * 3 + kx];
                        }
                long long r = (long long)nearbyintf((float)sum * mult) + q.output_zero_point;
                long long lo = q.output_zero_point; /* the fused ReLU */
                r = r < lo ? lo : (r > 255 ? 255 : r);
                long long got = y[(co * h + oy) * w + ox];
                if (got != r) bad++;
            }
    CHECK(bad == 0, "int8 (%s): %zu of %zu outputs differ from the definition",
          convkit_qplan_kernel_name(plan), bad, info.output_len);
    printf("ok  %-32s %-48s %zu outputs, exact\n", "int8 3x3 u8 same relu",
           convkit_qplan_kernel_name(plan), info.output_len);

    /* Wrong element count, and a residual on a u8 output. */
    FAILS(CONVKIT_ERROR_WRONG_LENGTH,
          convkit_qplan_run(plan, x, info.input_len - 1, y, info.output_len, workspace));
    float r1 = 0, o1 = 0;
    FAILS(CONVKIT_ERROR_INVALID_PARAMETER,
          convkit_qplan_run_residual(plan, x, info.input_len, &r1, 1, &o1, 1, workspace));
    free(x);
    free(y);

done:
    convkit_qplan_destroy(plan);
    convkit_qconv_destroy(conv);

    /* A 1-D int8 convolution with an f32 output and a residual: every output is
       (sum + bias) * input_scale * weight_scale + residual. */
    convkit_conv_params p1;
    OK(convkit_conv_params_init(&p1, 4, 4, 1, 3));
    p1.pad_left = p1.pad_right = 1;
    convkit_quant_params q1 = {CONVKIT_QTYPE_I8, -3, 0.5f, &wscale, 1, CONVKIT_QTYPE_F32, 0, 0};
    convkit_qconv *c1 = NULL;
    convkit_qplan *pl1 = NULL;
    OK(convkit_qconv1d_create(&p1, &q1, wt, 4 * 4 * 3, NULL, 0, NULL, &c1));
    OK(convkit_qconv_plan(c1, 1, 1, 10, &pl1));
    if (pl1) {
        int8_t x1[40];
        float r1v[40], y1[40];
        for (int i = 0; i < 40; i++) {
            x1[i] = (int8_t)(i * 7 - 100);
            r1v[i] = (float)i;
        }
        OK(convkit_qplan_run_residual(pl1, x1, 40, r1v, 40, y1, 40, NULL));
        size_t bad1 = 0;
        for (int co = 0; co < 4; co++)
            for (int ox = 0; ox < 10; ox++) {
                long long sum = 0;
                for (int ci = 0; ci < 4; ci++)
                    for (int k = 0; k < 3; k++) {
                        int ix = ox + k - 1;
                        if (ix < 0 || ix >= 10) continue;
                        sum += (long long)(x1[ci * 10 + ix] - q1.input_zero_point) *
                               wt[(co * 4 + ci) * 3 + k];
                    }
                float want = (float)sum * (float)((double)q1.input_scale * wscale) +
                             r1v[co * 10 + ox];
                if (fabsf(y1[co * 10 + ox] - want) > 1e-4f * (1.0f + fabsf(want))) bad1++;
            }
        CHECK(bad1 == 0, "int8 1-D f32 residual: %zu outputs differ", bad1);
        printf("ok  %-32s %-48s 40 outputs\n", "int8 1-D i8 -> f32 + residual",
               convkit_qplan_kernel_name(pl1));
    }
    convkit_qplan_destroy(pl1);
    convkit_qconv_destroy(c1);
    free(wt);
}

static void check_errors(convkit_workspace *workspace) {
    convkit_conv_params p;
    convkit_conv *conv = NULL;
    convkit_plan *plan = NULL;
    float wt[6 * 4 * 9] = {0};

    /* Channels not divisible by groups: the create fails and says so. */
    OK(convkit_conv_params_init(&p, 6, 4, 3, 3));
    p.groups = 4;
    FAILS(CONVKIT_ERROR_NOT_DIVISIBLE_BY_GROUPS,
          convkit_conv_create(&p, wt, 4 * 1 * 9, NULL, 0, NULL, &conv));
    CHECK(conv == NULL, "no handle on failure");
    CHECK(strstr(convkit_last_error_message(), "groups") != NULL, "message: %s",
          convkit_last_error_message());
    printf("ok  error message: %s\n", convkit_last_error_message());

    /* A zero stride, an unknown enum value, wrong weight count, NULL pointers. */
    OK(convkit_conv_params_init(&p, 4, 6, 3, 3));
    p.stride_w = 0;
    FAILS(CONVKIT_ERROR_ZERO, convkit_conv_create(&p, wt, 6 * 4 * 9, NULL, 0, NULL, &conv));
    p.stride_w = 1;
    p.layout = 7;
    FAILS(CONVKIT_ERROR_INVALID_PARAMETER,
          convkit_conv_create(&p, wt, 6 * 4 * 9, NULL, 0, NULL, &conv));
    p.layout = CONVKIT_LAYOUT_NCHW;
    FAILS(CONVKIT_ERROR_WRONG_LENGTH,
          convkit_conv_create(&p, wt, 6 * 4 * 9 - 1, NULL, 0, NULL, &conv));
    FAILS(CONVKIT_ERROR_NULL_POINTER,
          convkit_conv_create(&p, NULL, 6 * 4 * 9, NULL, 0, NULL, &conv));
    FAILS(CONVKIT_ERROR_NULL_POINTER,
          convkit_conv_create(NULL, wt, 6 * 4 * 9, NULL, 0, NULL, &conv));
    FAILS(CONVKIT_ERROR_NULL_POINTER,
          convkit_conv_create(&p, wt, 6 * 4 * 9, NULL, 0, NULL, NULL));
    FAILS(CONVKIT_ERROR_NULL_POINTER, convkit_conv_params_init(NULL, 1, 1, 1, 1));
    FAILS(CONVKIT_ERROR_NULL_POINTER, convkit_conv_plan(NULL, 1, 4, 4, &plan));
    FAILS(CONVKIT_ERROR_NULL_POINTER, convkit_plan_get_info(NULL, NULL));
    FAILS(CONVKIT_ERROR_NULL_POINTER, convkit_workspace_create(0, NULL));
    FAILS(CONVKIT_ERROR_NULL_POINTER, convkit_workspace_reserve(NULL, 16));
    convkit_options bad_isa = {0, 99, 0, 0};
    FAILS(CONVKIT_ERROR_INVALID_PARAMETER,
          convkit_conv_create(&p, wt, 6 * 4 * 9, NULL, 0, &bad_isa, &conv));
#if defined(__x86_64__)
    convkit_options neon = {0, CONVKIT_ISA_NEON, 0, 0};
    FAILS(CONVKIT_ERROR_ISA_UNAVAILABLE,
          convkit_conv_create(&p, wt, 6 * 4 * 9, NULL, 0, &neon, &conv));
#endif
    /* Winograd forced on a 1x1 convolution. */
    convkit_conv_params p1;
    OK(convkit_conv_params_init(&p1, 4, 6, 1, 1));
    convkit_options wino = {0, 0, 0, CONVKIT_ALGORITHM_WINOGRAD};
    FAILS(CONVKIT_ERROR_ALGORITHM_UNSUPPORTED,
          convkit_conv_create(&p1, wt, 6 * 4, NULL, 0, &wino, &conv));
    /* A 1-D create with a 3x3 kernel. */
    FAILS(CONVKIT_ERROR_INVALID_PARAMETER,
          convkit_conv1d_create(&p, wt, 6 * 4 * 9, NULL, 0, NULL, &conv));

    /* A kernel larger than the padded input: the plan fails. */
    OK(convkit_conv_create(&p, wt, 6 * 4 * 9, NULL, 0, NULL, &conv));
    CHECK(strlen(convkit_conv_algorithm(conv)) > 0, "algorithm name");
    FAILS(CONVKIT_ERROR_KERNEL_TOO_LARGE, convkit_conv_plan(conv, 1, 2, 8, &plan));
    FAILS(CONVKIT_ERROR_ZERO, convkit_conv_plan(conv, 0, 8, 8, &plan));
    OK(convkit_conv_plan(conv, 1, 5, 5, &plan));
    if (plan) {
        float x[4 * 25] = {0}, y[6 * 9];
        /* Wrong lengths, NULL tensors, overlapping output and input, misaligned output. */
        FAILS(CONVKIT_ERROR_WRONG_LENGTH, convkit_plan_run(plan, x, 99, y, 54, workspace));
        FAILS(CONVKIT_ERROR_WRONG_LENGTH, convkit_plan_run(plan, x, 100, y, 53, workspace));
        FAILS(CONVKIT_ERROR_NULL_POINTER, convkit_plan_run(plan, NULL, 100, y, 54, workspace));
        FAILS(CONVKIT_ERROR_NULL_POINTER, convkit_plan_run(plan, x, 100, NULL, 54, workspace));
        FAILS(CONVKIT_ERROR_INVALID_PARAMETER,
              convkit_plan_run(plan, x, 100, x + 10, 54, workspace));
        FAILS(CONVKIT_ERROR_WRONG_LENGTH,
              convkit_plan_run_residual(plan, x, 100, x, 53, y, 54, workspace));
        FAILS(CONVKIT_ERROR_INVALID_PARAMETER,
              convkit_plan_run_residual(plan, x, 100, y, 54, y, 54, workspace));
        unsigned char *raw = malloc(55 * sizeof(float));
        FAILS(CONVKIT_ERROR_INVALID_PARAMETER,
              convkit_plan_run(plan, x, 100, (float *)(void *)(raw + 1), 54, workspace));
        free(raw);
        /* Still usable after the errors, and without a workspace. */
        OK(convkit_plan_run(plan, x, 100, y, 54, NULL));
        CHECK(y[0] == 0.0f, "zero input gives zero output, got %g", (double)y[0]);
    }
    convkit_plan_destroy(plan);
    convkit_conv_destroy(conv);

    /* int8: a weight scale of 0, and NULL quant. */
    OK(convkit_conv_params_init(&p, 4, 4, 1, 1));
    int8_t qw[16] = {0};
    float zero = 0.0f;
    convkit_quant_params q = {CONVKIT_QTYPE_U8, 0, 1.0f, &zero, 1, CONVKIT_QTYPE_I32, 0, 0};
    convkit_qconv *qc = NULL;
    convkit_status s = convkit_qconv_create(&p, &q, qw, 16, NULL, 0, NULL, &qc);
    CHECK(s == CONVKIT_ERROR_INVALID_PARAMETER || s == CONVKIT_ERROR_NOT_BUILT, "got %s",
          convkit_status_name(s));
    s = convkit_qconv_create(&p, NULL, qw, 16, NULL, 0, NULL, &qc);
    CHECK(s == CONVKIT_ERROR_NULL_POINTER || s == CONVKIT_ERROR_NOT_BUILT, "got %s",
          convkit_status_name(s));
    FAILS(CONVKIT_ERROR_NULL_POINTER, convkit_qconv_plan(NULL, 1, 1, 1, NULL));
    FAILS(CONVKIT_ERROR_NULL_POINTER, convkit_qplan_get_info(NULL, NULL));
    FAILS(CONVKIT_ERROR_NULL_POINTER, convkit_qplan_run(NULL, NULL, 0, NULL, 0, NULL));

    /* Queries and destroys take NULL. */
    CHECK(strcmp(convkit_plan_kernel_name(NULL), "") == 0, "NULL plan name");
    CHECK(strcmp(convkit_qplan_kernel_name(NULL), "") == 0, "NULL qplan name");
    CHECK(strcmp(convkit_conv_algorithm(NULL), "") == 0, "NULL conv algorithm");
    CHECK(convkit_workspace_bytes(NULL) == 0, "NULL workspace bytes");
    convkit_conv_destroy(NULL);
    convkit_plan_destroy(NULL);
    convkit_qconv_destroy(NULL);
    convkit_qplan_destroy(NULL);
    convkit_workspace_destroy(NULL);
    CHECK(strcmp(convkit_status_name(CONVKIT_ERROR_PANIC), "CONVKIT_ERROR_PANIC") == 0,
          "status name");
    CHECK(strcmp(convkit_status_name(1234), "CONVKIT_UNKNOWN_STATUS") == 0, "status name");
    printf("ok  error cases\n");
}


/* Threads: one plan run by several threads at once, each with its own workspace, gives every
   thread the same output; a failure on one thread leaves another's last error alone. */
typedef struct {
    const convkit_plan *plan;
    const float *x;
    float *y;
    size_t in_len, out_len;
    convkit_status status;
    int message_kept;
} worker_job;

static void *worker(void *arg) {
    worker_job *job = arg;
    convkit_workspace *ws = NULL;
    job->status = convkit_workspace_create(0, &ws);
    for (int round = 0; round < 20 && job->status == CONVKIT_OK; round++)
        job->status = convkit_plan_run(job->plan, job->x, job->in_len, job->y, job->out_len, ws);
    /* This thread has not failed: its last error is still empty. */
    job->message_kept = strcmp(convkit_last_error_message(), "") == 0;
    convkit_workspace_destroy(ws);
    return NULL;
}

static void check_threads(void) {
    convkit_conv_params p;
    OK(convkit_conv_params_init(&p, 16, 16, 3, 3));
    p.padding = CONVKIT_PADDING_SAME;
    float *wt = random_floats(16 * 16 * 9);
    convkit_conv *conv = NULL;
    convkit_plan *plan = NULL;
    OK(convkit_conv_create(&p, wt, 16 * 16 * 9, NULL, 0, NULL, &conv));
    OK(convkit_conv_plan(conv, 1, 20, 20, &plan));
    convkit_conv_destroy(conv); /* the plan keeps what it needs */
    if (!plan) {
        free(wt);
        return;
    }
    convkit_plan_info info;
    OK(convkit_plan_get_info(plan, &info));
    float *x = random_floats(info.input_len);
    float *want = malloc(info.output_len * sizeof(float));
    OK(convkit_plan_run(plan, x, info.input_len, want, info.output_len, NULL));
    enum { N = 4 };
    pthread_t tid[N];
    worker_job jobs[N];
    for (int i = 0; i < N; i++) {
        jobs[i] = (worker_job){plan, x, malloc(info.output_len * sizeof(float)), info.input_len,
                               info.output_len, -1, 0};
        CHECK(pthread_create(&tid[i], NULL, worker, &jobs[i]) == 0, "pthread_create");
    }
    /* Meanwhile this thread fails: its own message changes, not the workers'. */
    FAILS(CONVKIT_ERROR_WRONG_LENGTH, convkit_plan_run(plan, x, 1, want, info.output_len, NULL));
    for (int i = 0; i < N; i++) {
        pthread_join(tid[i], NULL);
        CHECK(jobs[i].status == CONVKIT_OK, "thread %d: %s", i,
              convkit_status_name(jobs[i].status));
        CHECK(jobs[i].message_kept, "thread %d saw another thread's error", i);
        CHECK(memcmp(jobs[i].y, want, info.output_len * sizeof(float)) == 0,
              "thread %d: a different result", i);
        free(jobs[i].y);
    }
    printf("ok  %d threads share one plan, each its own workspace\n", N);
    convkit_plan_destroy(plan);
    free(x);
    free(want);
    free(wt);
}

int main(void) {
    printf("convkit %s, ABI %u, best ISA %d\n", convkit_version(), convkit_abi_version(),
           convkit_best_isa());
    CHECK(convkit_abi_version() == CONVKIT_ABI_VERSION, "ABI version");
#ifdef CONVKIT_EXPECTED_VERSION
    CHECK(strcmp(convkit_version(), CONVKIT_EXPECTED_VERSION) == 0, "version %s",
          convkit_version());
#endif
    CHECK(convkit_best_isa() >= CONVKIT_ISA_SCALAR && convkit_best_isa() <= CONVKIT_ISA_NEON,
          "best ISA");

    convkit_workspace *ws = NULL;
    OK(convkit_workspace_create(0, &ws));
    OK(convkit_workspace_reserve(ws, 1000));
    CHECK(convkit_workspace_bytes(ws) >= 1000, "reserve");

    convkit_conv_params p;

    /* A 3x3, NCHW, bias + ReLU, batch 2. */
    OK(convkit_conv_params_init(&p, 8, 16, 3, 3));
    p.pad_top = p.pad_bottom = p.pad_left = p.pad_right = 1;
    p.activation = CONVKIT_ACTIVATION_RELU;
    check_conv("3x3 nchw bias relu", &p, NULL, 2, 12, 11, 1, 0, 0, ws);

    /* The same on NHWC, SAME padding, stride 2, exact precision on the caller's thread. */
    p.padding = CONVKIT_PADDING_SAME;
    p.stride_h = p.stride_w = 2;
    p.layout = CONVKIT_LAYOUT_NHWC;
    convkit_options one_thread = {1, CONVKIT_ISA_AUTO, CONVKIT_PRECISION_EXACT,
                                  CONVKIT_ALGORITHM_AUTO};
    check_conv("3x3s2 nhwc same relu", &p, &one_thread, 1, 13, 10, 1, 0, 0, ws);

    /* 3x3 with many channels (Winograd's territory), residual, SiLU. */
    OK(convkit_conv_params_init(&p, 32, 32, 3, 3));
    p.padding = CONVKIT_PADDING_SAME;
    p.activation = CONVKIT_ACTIVATION_SILU;
    check_conv("3x3 32ch nchw residual silu", &p, NULL, 1, 14, 14, 1, 1, 0, ws);

    /* Depthwise 3x3 NHWC, stride 2, SAME_LOWER, ReLU6, channel multiplier 1. */
    OK(convkit_conv_params_init(&p, 24, 24, 3, 3));
    p.groups = 24;
    p.stride_h = p.stride_w = 2;
    p.padding = CONVKIT_PADDING_SAME_LOWER;
    p.layout = CONVKIT_LAYOUT_NHWC;
    p.activation = CONVKIT_ACTIVATION_RELU6;
    check_conv("depthwise 3x3s2 nhwc relu6", &p, NULL, 1, 15, 16, 1, 0, 0, ws);

    /* Depthwise 5x5 NCHW with multiplier 2, no bias, clamp. */
    OK(convkit_conv_params_init(&p, 8, 16, 5, 5));
    p.groups = 8;
    p.pad_top = p.pad_bottom = p.pad_left = p.pad_right = 2;
    p.activation = CONVKIT_ACTIVATION_CLAMP;
    p.activation_min = -0.5f;
    p.activation_max = 0.75f;
    check_conv("depthwise 5x5 x2 nchw clamp", &p, NULL, 1, 11, 9, 0, 0, 0, ws);

    /* Grouped 3x3, 4 groups, dilation 2, leaky ReLU, residual, NCHW and NHWC. */
    OK(convkit_conv_params_init(&p, 16, 12, 3, 3));
    p.groups = 4;
    p.dilation_h = p.dilation_w = 2;
    p.pad_top = p.pad_left = 2;
    p.pad_bottom = p.pad_right = 1;
    p.activation = CONVKIT_ACTIVATION_LEAKY_RELU;
    p.activation_alpha = 0.1f;
    check_conv("grouped 3x3 d2 nchw leaky", &p, NULL, 2, 10, 9, 1, 1, 0, ws);
    p.layout = CONVKIT_LAYOUT_NHWC;
    check_conv("grouped 3x3 d2 nhwc leaky", &p, NULL, 1, 10, 9, 1, 1, 0, NULL);

    /* 1x1 NHWC forced onto im2col + GEMM at the scalar level, sigmoid. */
    OK(convkit_conv_params_init(&p, 20, 7, 1, 1));
    p.layout = CONVKIT_LAYOUT_NHWC;
    p.activation = CONVKIT_ACTIVATION_SIGMOID;
    convkit_options scalar = {2, CONVKIT_ISA_SCALAR, CONVKIT_PRECISION_BALANCED,
                              CONVKIT_ALGORITHM_IM2COL_GEMM};
    check_conv("1x1 nhwc scalar gemm sigmoid", &p, &scalar, 1, 6, 5, 1, 0, 0, ws);

    /* 1-D: kernel 5, stride 2, padding 2, NCW. */
    OK(convkit_conv_params_init(&p, 6, 10, 1, 5));
    p.stride_w = 2;
    p.pad_left = p.pad_right = 2;
    check_conv("1-D k5s2 ncw", &p, NULL, 2, 1, 33, 1, 0, 1, ws);

    check_int8(ws);
    check_errors(ws);
    check_threads();
    convkit_workspace_destroy(ws);

    if (failures) {
        fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
