// Dense and grouped convolution as a tiled implicit GEMM: per group, C[m][n] = sum_k A[m][k] B[k][n]
// with m the group's output channel, n an output pixel of the batch (b, oy, ox) and k an input
// tap (ci, ky, kx). A is the weights as stored (OIHW rows are contiguous in k); B is never
// materialised: each 16x64 tile of it is gathered from the input into workgroup memory, with
// padding read as zeros. 256 threads compute a 64x64 tile, 4x4 outputs each.
// Prepended at create time: common.wgsl.

const TILE: u32 = 64u;
const BK: u32 = 16u;

var<workgroup> a_tile: array<f32, 1024>; // [k][m]
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

    var acc: array<f32, 16>;
    for (var i = 0u; i < 16u; i++) {
        acc[i] = 0.0;
    }

    for (var k0 = 0u; k0 < k_len; k0 += BK) {
        // Each thread loads 4 of A's 1024 and 4 of B's: element e = t + 256 j is (k = e / 64, col = e % 64).
        for (var j = 0u; j < 4u; j++) {
            let e = t + 256u * j;
            let kk = e / TILE;
            let col = e % TILE;
            let k = k0 + kk;
            let m = m0 + col;
            var a = 0.0;
            if (k < k_len && m < d.cout_g) {
                a = weights[(g * d.cout_g + m) * k_len + k];
            }
            a_tile[kk * TILE + col] = a;

            let n = n0 + col;
            var bv = 0.0;
            if (k < k_len && n < n_len) {
                let ci = k / taps;
                let r = k % taps;
                let ky = r / d.kw;
                let kx = r % d.kw;
                let b = n / pixels;
                let p = n % pixels;
                let oy = p / d.ow;
                let ox = p % d.ow;
                let iy = i32(oy * d.sh + ky * d.dh) - i32(d.pad_top);
                let ix = i32(ox * d.sw + kx * d.dw) - i32(d.pad_left);
                bv = load_input(b, g * d.cin_g + ci, iy, ix);
            }
            b_tile[kk * TILE + col] = bv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            var av: array<f32, 4>;
            var bw: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                av[i] = a_tile[kk * TILE + lid.y + 16u * i];
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
