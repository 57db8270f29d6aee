// Depthwise convolution (one input channel a group, any channel multiplier): one thread an
// output, the taps read straight from the input (padding read as zeros). The grid is 2-D so
// that more than 65535 workgroups of outputs can run.
// Prepended at create time: common.wgsl.

@compute @workgroup_size(256, 1, 1)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let idx = (wg.y * nwg.x + wg.x) * 256u + li;
    let total = d.batch * d.c_out * d.oh * d.ow;
    if (idx >= total) {
        return;
    }
    // idx runs over the outputs in memory order, so neighbouring threads read neighbouring
    // input words: (b, c, oy, ox) for NCHW, (b, oy, ox, c) for NHWC.
    var c: u32;
    var ox: u32;
    var oy: u32;
    if (d.nhwc == 1u) {
        c = idx % d.c_out;
        ox = (idx / d.c_out) % d.ow;
        oy = (idx / (d.c_out * d.ow)) % d.oh;
    } else {
        ox = idx % d.ow;
        oy = (idx / d.ow) % d.oh;
        c = (idx / (d.ow * d.oh)) % d.c_out;
    }
    let b = idx / (d.ow * d.oh * d.c_out);
    let ci = c / d.cout_g;
    var sum = 0.0;
    for (var ky = 0u; ky < d.kh; ky++) {
        let iy = i32(oy * d.sh + ky * d.dh) - i32(d.pad_top);
        for (var kx = 0u; kx < d.kw; kx++) {
            let ix = i32(ox * d.sw + kx * d.dw) - i32(d.pad_left);
            sum = fma(weights[(c * d.kh + ky) * d.kw + kx], load_input(b, ci, iy, ix), sum);
        }
    }
    store(b, c, oy, ox, sum);
}
