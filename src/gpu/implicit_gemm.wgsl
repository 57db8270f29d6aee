// Dense and grouped convolution as a tiled implicit GEMM: per group, C[m][n] = sum_k A[m][k] B[k][n]
// with m the group's output channel, n an output pixel of the batch (b, oy, ox) and k an input
// tap (ci, ky, kx). A is the weights as stored (OIHW rows are contiguous in k); B is never
// materialised: each 16x64 tile of it is gathered from the input into workgroup memory, with
// padding read as zeros. 256 threads compute a 64x64 tile, 4x4 outputs each.
// Prepended at create time: common.wgsl.

const TILE: u32 = 64u;
const BK: u32 = 16u;

var<workgroup> a_tile: array<f32, 1040>; // [k][m], rows of 65 so the transposing stores spread over banks
var<workgroup> b_tile: array<f32, 1024>; // [k][n]

@compute @workgroup_size(16, 16, 1)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = wg.z;
    let m0 = wg.y * TILE;
    let n0 = wg.x * TILE;
    let taps = d.kh * d.kw;
    let k_len = d.cin_g * taps;
    let pixels = d.oh * d.ow;
    let n_len = d.batch * pixels;
    let t = lid.y * 16u + lid.x;

    // This thread loads A row m0 + t / 4 at k offsets 4 (t % 4) .. +3 (a weight row is
    // contiguous in k, so neighbours read neighbouring words), and B column n0 + t % 64 at k
    // offsets t / 64 + 4 j: its output pixel is decoded once, not once per tap.
    let a_m = t / 4u;
    let a_k = (t % 4u) * 4u;
    let a_valid = m0 + a_m < d.cout_g;
    let a_row = (g * d.cout_g + m0 + a_m) * k_len;
    let b_col = t % TILE;
    let b_k = t / TILE;
    let n = n0 + b_col;
    let b_valid = n < n_len;
    let b_img = n / pixels;
    let p = n % pixels;
    let iy0 = i32((p / d.ow) * d.sh) - i32(d.pad_top);
    let ix0 = i32((p % d.ow) * d.sw) - i32(d.pad_left);

    var acc: array<f32, 16>;
    for (var i = 0u; i < 16u; i++) {
        acc[i] = 0.0;
    }

    for (var k0 = 0u; k0 < k_len; k0 += BK) {
        for (var j = 0u; j < 4u; j++) {
            let ka = a_k + j;
            var a = 0.0;
            if (a_valid && k0 + ka < k_len) {
                a = weights[a_row + k0 + ka];
            }
            a_tile[ka * 65u + a_m] = a;

            let kb = b_k + 4u * j;
            let k = k0 + kb;
            var bv = 0.0;
            if (b_valid && k < k_len) {
                let ci = k / taps;
                let r = k % taps;
                let iy = iy0 + i32((r / d.kw) * d.dh);
                let ix = ix0 + i32((r % d.kw) * d.dw);
                bv = load_input(b_img, g * d.cin_g + ci, iy, ix);
            }
            b_tile[kb * TILE + b_col] = bv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            var av: array<f32, 4>;
            var bw: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                av[i] = a_tile[kk * 65u + lid.y + 16u * i];
                bw[i] = b_tile[kk * TILE + lid.x + 16u * i];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i * 4u + j] = fma(av[i], bw[j], acc[i * 4u + j]);
                }
            }
        }
        workgroupBarrier();
    }

    for (var i = 0u; i < 4u; i++) {
        let m = m0 + lid.y + 16u * i;
        if (m >= d.cout_g) {
            continue;
        }
        for (var j = 0u; j < 4u; j++) {
            let n = n0 + lid.x + 16u * j;
            if (n >= n_len) {
                continue;
            }
            let b = n / pixels;
            let p = n % pixels;
            store(b, g * d.cout_g + m, p / d.ow, p % d.ow, acc[i * 4u + j]);
        }
    }
}
