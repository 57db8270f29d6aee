/*
 * A MobileNetV2 inverted-residual block through convkit's C ABI: 1x1 expand + ReLU6, 3x3
 * depthwise + ReLU6, 1x1 project + residual, all three layers sharing one workspace.
 *
 *   cargo build --release --features capi
 *   cc -std=c11 -Iinclude examples/c/mobilenet_block.c target/release/libconvkit.a \
 *      -lpthread -ldl -lm -o mobilenet_block && ./mobilenet_block
 *
 * (tests/capi.rs builds and runs it.)
 */
#include "convkit.h"

#include <stdio.h>
#include <stdlib.h>

#define TRY(call)                                                                          \
    do {                                                                                   \
        convkit_status s_ = (call);                                                        \
        if (s_ != CONVKIT_OK) {                                                            \
            fprintf(stderr, "%s failed: %s: %s\n", #call, convkit_status_name(s_),         \
                    convkit_last_error_message());                                         \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static float *filled(size_t n, unsigned seed) {
    float *v = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        v[i] = (float)((seed >> 8) & 0xffff) / 65536.0f - 0.5f;
    }
    return v;
}

int main(void) {
    const size_t c = 24, hidden = 6 * 24, size = 56;
    convkit_conv_params p[3];
    TRY(convkit_conv_params_init(&p[0], c, hidden, 1, 1)); /* expand */
    p[0].activation = CONVKIT_ACTIVATION_RELU6;
    TRY(convkit_conv_params_init(&p[1], hidden, hidden, 3, 3)); /* depthwise */
    p[1].groups = hidden;
    p[1].padding = CONVKIT_PADDING_SAME;
    p[1].activation = CONVKIT_ACTIVATION_RELU6;
    TRY(convkit_conv_params_init(&p[2], hidden, c, 1, 1)); /* project */
    const char *names[3] = {"expand 1x1", "depthwise 3x3", "project 1x1"};

    convkit_conv *conv[3];
    convkit_plan *plan[3];
    convkit_plan_info info[3];
    size_t scratch_sum = 0;
    for (int i = 0; i < 3; i++) {
        size_t wlen = p[i].out_channels * (p[i].in_channels / p[i].groups) * p[i].kernel_h *
                      p[i].kernel_w;
        float *w = filled(wlen, 10u + (unsigned)i), *b = filled(p[i].out_channels, 20u + (unsigned)i);
        TRY(convkit_conv_create(&p[i], w, wlen, b, p[i].out_channels, NULL, &conv[i]));
        free(w); /* convkit packed its own copy */
        free(b);
        TRY(convkit_conv_plan(conv[i], 1, size, size, &plan[i]));
        TRY(convkit_plan_get_info(plan[i], &info[i]));
        scratch_sum += info[i].workspace_bytes;
    }

    convkit_workspace *ws;
    TRY(convkit_workspace_create(0, &ws)); /* grows to the largest layer's scratch */
    float *x = filled(info[0].input_len, 1);
    float *t1 = malloc(info[0].output_len * sizeof(float));
    float *t2 = malloc(info[1].output_len * sizeof(float));
    float *y = malloc(info[2].output_len * sizeof(float));
    TRY(convkit_plan_run(plan[0], x, info[0].input_len, t1, info[0].output_len, ws));
    TRY(convkit_plan_run(plan[1], t1, info[1].input_len, t2, info[1].output_len, ws));
    TRY(convkit_plan_run_residual(plan[2], t2, info[2].input_len, x, info[0].input_len, y,
                                  info[2].output_len, ws));

    printf("MobileNetV2 inverted residual block (C): %zu -> %zu -> %zu channels, %zux%zu\n", c,
           hidden, c, size, size);
    for (int i = 0; i < 3; i++)
        printf("  %-14s %-44s scratch %9zu bytes\n", names[i], convkit_plan_kernel_name(plan[i]),
               info[i].workspace_bytes);
    double checksum = 0;
    for (size_t i = 0; i < info[2].output_len; i++) checksum += y[i];
    printf("peak workspace %zu bytes (one shared workspace) vs %zu bytes summed over the layers\n",
           convkit_workspace_bytes(ws), scratch_sum);
    printf("output checksum %.6f\n", checksum);

    for (int i = 0; i < 3; i++) {
        convkit_plan_destroy(plan[i]);
        convkit_conv_destroy(conv[i]);
    }
    convkit_workspace_destroy(ws);
    free(x);
    free(t1);
    free(t2);
    free(y);
    return 0;
}
