//! `run` allocates nothing once the workspace is large enough: a counting global allocator
//! watches every allocation the test's thread makes while it runs.

use convkit::{
    Accumulate, Activation, Conv2d, ConvBackward, ConvParams, ConvTranspose2d, Isa, Layout,
    Options, Padding, Workspace,
};
use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    /// Whether counting is on, and the count, for this thread alone: the test's runs are on
    /// the caller's thread, while other tests and the harness allocate on theirs.
    static ON: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

/// Allocations `f` makes on this thread.
fn count(f: impl FnOnce()) -> usize {
    let before = ALLOCATIONS.with(Cell::get);
    ON.with(|on| on.set(true));
    f();
    ON.with(|on| on.set(false));
    ALLOCATIONS.with(Cell::get) - before
}

fn note() {
    // `try_with`: a thread being torn down has no thread-locals left to ask.
    if ON.try_with(Cell::get).unwrap_or(false) {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
    }
}

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn run_does_not_allocate() {
    // Each layer with the path it must take, so that a change of the rules cannot quietly
    // leave a path untested.
    let layers = [
        (
            ConvParams::conv2d(24, 32, [3, 3])
                .with_padding(Padding::Same)
                .with_activation(Activation::Silu),
            "winograd/wino_f32_f4_2d",
        ),
        (
            ConvParams::conv2d(24, 32, [3, 3])
                .with_padding(Padding::Same)
                .with_dilation([2, 2]),
            "im2col_gemm/",
        ),
        (
            ConvParams::conv2d(32, 32, [3, 3])
                .with_groups(32)
                .with_stride([2, 2])
                .with_padding(Padding::uniform(1)),
            "depthwise/dw_f32_k3s2_nchw",
        ),
        (
            ConvParams::conv2d(32, 64, [1, 1])
                .with_layout(Layout::Nhwc)
                .with_activation(Activation::Relu),
            "im2col_gemm/",
        ),
        // Depthwise 4x4 (the generic kernel) without padding: the blocked mode, whose
        // transposes use the workspace.
        (
            ConvParams::conv2d(24, 24, [4, 4])
                .with_groups(24)
                .with_padding(Padding::Valid)
                .with_activation(Activation::Gelu),
            "depthwise/transpose16+dw_f32_generic_nhwc",
        ),
        // Dilated depthwise 3x3, "same": the flat kernel (AVX2 and up), with the plan's mask
        // table.
        (
            ConvParams::conv2d(24, 48, [3, 3])
                .with_groups(24)
                .with_dilation([2, 2])
                .with_padding(Padding::Same)
                .with_activation(Activation::Gelu),
            if matches!(Isa::default_level(), Ok(Isa::Avx2 | Isa::Avx512)) {
                "depthwise/dw_f32_flat_nchw"
            } else {
                "depthwise/dw_f32_generic_nchw"
            },
        ),
        (
            ConvParams::conv2d(24, 24, [5, 5])
                .with_groups(24)
                .with_layout(Layout::Nhwc),
            "depthwise/dw_f32_k5s1_nhwc",
        ),
        (
            ConvParams::conv2d(32, 32, [3, 3])
                .with_groups(8)
                .with_padding(Padding::uniform(1)),
            "direct/direct_f32_k3s1",
        ),
        (
            ConvParams::conv2d(3, 16, [7, 7])
                .with_stride([2, 2])
                .with_padding(Padding::uniform(3)),
            "direct/direct_f32_k7s2",
        ),
    ];
    let mut ws = Workspace::new();
    for (params, path) in layers {
        let weights = vec![0.1; params.weights_len().unwrap()];
        let bias = vec![0.2; params.out_channels];
        let conv = Conv2d::new(params, &weights, Some(&bias), Options::threads(1)).unwrap();
        let plan = conv.plan(2, 20, 20).unwrap();
        assert!(
            plan.kernel_name().starts_with(path),
            "expected {path}, got {}",
            plan.kernel_name()
        );
        let input = vec![1.0; plan.input_len()];
        let residual = vec![0.5; plan.output_len()];
        let mut output = vec![0.0; plan.output_len()];
        ws.reserve(plan.workspace_bytes()).unwrap();
        let n = count(|| {
            plan.run(&input, &mut output, &mut ws).unwrap();
            plan.run_with_residual(&input, &residual, &mut output, &mut ws)
                .unwrap();
        });
        assert_eq!(n, 0, "{} allocated {n} times", plan.kernel_name());
        assert!(output.iter().all(|v| v.is_finite()));
    }
}

/// The backward passes and transposed convolution allocate nothing either, on every path:
/// the stride-1 forward convolution (with accumulation through the workspace), col2im, the
/// depthwise kernels, the Winograd weight gradient (the first layer), the tap GEMMs, the
/// per-channel and the blocked weight kernels.
#[test]
fn backward_passes_do_not_allocate() {
    let layers = [
        ConvParams::conv2d(24, 32, [3, 3]).with_padding(Padding::Same),
        ConvParams::conv2d(24, 32, [3, 3])
            .with_stride([2, 2])
            .with_padding(Padding::uniform(1))
            .with_layout(Layout::Nhwc),
        ConvParams::conv2d(32, 32, [3, 3])
            .with_groups(32)
            .with_stride([2, 2])
            .with_padding(Padding::uniform(1)),
        ConvParams::conv2d(16, 32, [3, 3]).with_groups(16),
        ConvParams::conv2d(32, 32, [3, 3]).with_groups(8),
    ];
    let mut ws = Workspace::new();
    for params in layers {
        let weights = vec![0.1; params.weights_len().unwrap()];
        let plan = ConvBackward::new(params, &weights, Options::threads(1))
            .unwrap()
            .plan(2, 20, 20)
            .unwrap();
        let (x, dy) = (vec![1.0; plan.input_len()], vec![0.5; plan.output_len()]);
        let (mut dx, mut dw) = (vec![0.0; plan.input_len()], vec![0.0; weights.len()]);
        let mut db = vec![0.0; params.out_channels];
        ws.reserve(plan.workspace_bytes()).unwrap();
        let n = count(|| {
            for acc in [Accumulate::Overwrite, Accumulate::Add] {
                plan.backward_data(&dy, &mut dx, acc, &mut ws).unwrap();
                plan.backward_weights(&x, &dy, &mut dw, Some(&mut db), acc, &mut ws)
                    .unwrap();
            }
        });
        assert_eq!(n, 0, "{} allocated {n} times", plan.kernel_name());
        assert!(dx.iter().chain(&dw).all(|v| v.is_finite()));

        // The same layer's transposed convolution, with its epilogue.
        let t = ConvParams {
            in_channels: params.out_channels,
            out_channels: params.in_channels,
            activation: Activation::Silu,
            ..params
        };
        let bias = vec![0.2; t.out_channels];
        let plan = ConvTranspose2d::new(t, [0, 0], &weights, Some(&bias), Options::threads(1))
            .unwrap()
            .plan(2, 10, 10)
            .unwrap();
        let (x, residual) = (vec![1.0; plan.input_len()], vec![0.5; plan.output_len()]);
        let mut y = vec![0.0; plan.output_len()];
        ws.reserve(plan.workspace_bytes()).unwrap();
        let n = count(|| {
            plan.run(&x, &mut y, &mut ws).unwrap();
            plan.run_with_residual(&x, &residual, &mut y, &mut ws)
                .unwrap();
        });
        assert_eq!(
            n,
            0,
            "transposed {} allocated {n} times",
            plan.kernel_name()
        );
    }
}

#[cfg(feature = "int8")]
#[test]
fn quantized_run_does_not_allocate() {
    use convkit::{QConv2d, QuantOutput, QuantParams, QuantType};
    let dw = |layout| {
        ConvParams::conv2d(16, 16, [3, 3])
            .with_groups(16)
            .with_padding(Padding::Same)
            .with_layout(layout)
    };
    let layers = [
        (
            ConvParams::conv2d(24, 40, [3, 3]).with_padding(Padding::Same),
            "im2col_gemm/",
            12,
        ),
        (
            ConvParams::conv2d(32, 40, [1, 1]).with_layout(Layout::Nhwc),
            "im2col_gemm/",
            12,
        ),
        (dw(Layout::Nchw), "depthwise/", 12),
        (dw(Layout::Nhwc), "depthwise/", 12),
        // 7x7 planes: the small-plane kernel where the CPU has it (AVX-512 VNNI and VBMI).
        (dw(Layout::Nchw), "depthwise/", 7),
        (dw(Layout::Nhwc), "depthwise/", 7),
        // Grouped, 4 channels a group: exactly through the f32 direct kernels.
        (
            ConvParams::conv2d(32, 32, [3, 3])
                .with_groups(8)
                .with_padding(Padding::Same),
            "exact_f32/",
            12,
        ),
    ];
    let mut ws = Workspace::new();
    for (params, path, size) in layers {
        for input_type in [QuantType::U8, QuantType::I8] {
            let weights = vec![3i8; params.weights_len().unwrap()];
            let bias = vec![7i32; params.out_channels];
            let quant = QuantParams {
                input_type,
                input_scale: 0.1,
                input_zero_point: 5,
                weight_scales: vec![0.01],
                output: QuantOutput::I32,
            };
            let conv =
                QConv2d::new(params, quant, &weights, Some(&bias), Options::threads(1)).unwrap();
            let plan = conv.plan(2, size, size).unwrap();
            let small = size == 7
                && convkit::cpu::has_vnni_vbmi()
                && matches!(Isa::default_level(), Ok(Isa::Avx512));
            assert!(
                plan.kernel_name().starts_with(path)
                    && plan.kernel_name().contains("plane64") == small,
                "{}",
                plan.kernel_name()
            );
            let mut output = vec![0i32; plan.output_len()];
            ws.reserve(plan.workspace_bytes()).unwrap();
            let (x8, xu) = (vec![1i8; plan.input_len()], vec![1u8; plan.input_len()]);
            let n = count(|| match input_type {
                QuantType::U8 => plan.run(&xu, &mut output, &mut ws).unwrap(),
                QuantType::I8 => plan.run(&x8, &mut output, &mut ws).unwrap(),
            });
            assert_eq!(n, 0, "{} allocated {n} times", plan.kernel_name());
        }
    }
}

/// 16-bit runs (f16 and bf16 in; the same type or f32 out) allocate nothing either, on every
/// path: the 16-bit depthwise kernels, the f32 depthwise kernels on converted tiles and
/// blocks, and the bands of rows around GEMM, Winograd and the direct kernels; the workspace
/// they take stays bounded whatever the image size.
#[test]
fn storage_run_does_not_allocate() {
    use convkit::{bf16, f16, Storage};
    fn runs<I: Storage, O: Storage>(plan: &convkit::Plan, ws: &mut Workspace) -> usize {
        let input = vec![I::from_f32(1.0); plan.input_len()];
        let residual = vec![O::from_f32(0.5); plan.output_len()];
        let mut output = vec![O::from_f32(0.0); plan.output_len()];
        ws.reserve(plan.storage_workspace_bytes::<I, O>()).unwrap();
        let n = count(|| {
            plan.run_storage(&input, &mut output, ws).unwrap();
            plan.run_storage_with_residual(&input, &residual, &mut output, ws)
                .unwrap();
        });
        assert!(output.iter().all(|v| v.to_f32().is_finite()));
        n
    }
    let dw = |k: usize, layout| {
        ConvParams::conv2d(24, 24, [k, k])
            .with_groups(24)
            .with_padding(Padding::Same)
            .with_layout(layout)
    };
    let layers = [
        (dw(3, Layout::Nchw), "depthwise/"),
        (dw(3, Layout::Nhwc), "depthwise/"),
        (
            dw(7, Layout::Nchw).with_activation(Activation::Silu),
            "depthwise/",
        ),
        (
            ConvParams::conv2d(24, 32, [3, 3])
                .with_padding(Padding::Same)
                .with_activation(Activation::Silu),
            "winograd/",
        ),
        (
            ConvParams::conv2d(32, 64, [1, 1]).with_layout(Layout::Nhwc),
            "im2col_gemm/",
        ),
        (
            ConvParams::conv2d(3, 16, [7, 7])
                .with_stride([2, 2])
                .with_padding(Padding::uniform(3)),
            "direct/",
        ),
    ];
    let mut ws = Workspace::new();
    for (params, path) in layers {
        let weights = vec![f16::from_f32(0.1); params.weights_len().unwrap()];
        let bias = vec![f16::from_f32(0.2); params.out_channels];
        let conv =
            Conv2d::from_storage(params, &weights, Some(&bias), Options::threads(1)).unwrap();
        // A large image: several bands of rows; the workspace stays a few MiB.
        let plan = conv.plan(1, 96, 80).unwrap();
        assert!(
            plan.kernel_name().starts_with(path),
            "{}",
            plan.kernel_name()
        );
        for (what, n) in [
            ("f16 -> f16", runs::<f16, f16>(&plan, &mut ws)),
            ("bf16 -> bf16", runs::<bf16, bf16>(&plan, &mut ws)),
            ("f16 -> f32", runs::<f16, f32>(&plan, &mut ws)),
            ("bf16 -> f32", runs::<bf16, f32>(&plan, &mut ws)),
        ] {
            assert_eq!(
                n,
                0,
                "{what} {} allocated {n} times",
                plan.storage_kernel_name::<f16, f16>()
            );
        }
        let bytes = plan.storage_workspace_bytes::<f16, f32>();
        assert!(
            bytes <= 8 << 20,
            "{}: {bytes} bytes of workspace",
            plan.kernel_name()
        );
    }
}

#[test]
fn the_counter_sees_an_allocation() {
    let n = count(|| {
        std::hint::black_box(vec![1u8; 10]);
    });
    assert_eq!(n, 1);
}
