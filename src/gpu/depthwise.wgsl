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
    // idx runs over (b, c, oy, ox) in NCHW order whatever the layout; `store` places it.
    let ox = idx % d.ow;
    let oy = (idx / d.ow) % d.oh;
    let c = (idx / (d.ow * d.oh)) % d.c_out;
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
