//! Every bad input is a typed error naming its values, never a panic.

use convkit::{Activation, Conv1d, Conv2d, ConvParams, Error, Isa, Options, Padding, Workspace};

fn p() -> ConvParams {
    ConvParams::conv2d(4, 8, [3, 3])
}

fn new(params: ConvParams) -> Result<Conv2d, Error> {
    let n = params.weights_len().unwrap_or(0);
    Conv2d::new(params, &vec![0.0; n], None, Options::threads(1))
}

#[test]
fn zero_sizes_are_rejected() {
    let cases: [(ConvParams, &str); 6] = [
        (
            ConvParams {
                in_channels: 0,
                ..p()
            },
            "in_channels",
        ),
        (
            ConvParams {
                out_channels: 0,
                ..p()
            },
            "out_channels",
        ),
        (p().with_groups(0), "groups"),
        (
            ConvParams {
                kernel: [0, 3],
                ..p()
            },
            "kernel height",
        ),
        (p().with_stride([1, 0]), "stride width"),
        (p().with_dilation([0, 1]), "dilation height"),
    ];
    for (params, what) in cases {
        let e = new(params).err().expect("zero size must fail");
        assert_eq!(e, Error::Zero { what });
        assert!(e.to_string().contains(what), "{e}");
    }
}

#[test]
fn zero_input_sizes_are_rejected() {
    let conv = new(p().with_padding(Padding::Same)).unwrap();
    assert_eq!(
        conv.plan(0, 4, 4).err(),
        Some(Error::Zero { what: "batch" })
    );
    assert_eq!(
        conv.plan(1, 0, 4).err(),
        Some(Error::Zero {
            what: "input height"
        })
    );
    assert_eq!(
        conv.plan(1, 4, 0).err(),
        Some(Error::Zero {
            what: "input width"
        })
    );
}

#[test]
fn channels_not_divisible_by_groups() {
    let e = new(ConvParams::conv2d(6, 8, [3, 3]).with_groups(4))
        .err()
        .unwrap();
    assert_eq!(
        e,
        Error::NotDivisibleByGroups {
            what: "in_channels",
            channels: 6,
            groups: 4
        }
    );
    assert!(
        e.to_string().contains("6") && e.to_string().contains("4"),
        "{e}"
    );
    let e = new(ConvParams::conv2d(8, 6, [3, 3]).with_groups(4))
        .err()
        .unwrap();
    assert_eq!(
        e,
        Error::NotDivisibleByGroups {
            what: "out_channels",
            channels: 6,
            groups: 4
        }
    );
}

#[test]
fn kernel_larger_than_padded_input() {
    let conv = new(ConvParams::conv2d(1, 1, [5, 3])
        .with_dilation([2, 1])
        .with_padding(Padding::uniform(1)))
    .unwrap();
    let e = conv.plan(1, 6, 10).err().unwrap();
    match &e {
        Error::KernelTooLarge {
            axis,
            kernel,
            dilation,
            span,
            padded,
            ..
        } => {
            assert_eq!(
                (*axis, *kernel, *dilation, *span, *padded),
                ("height", 5, 2, 9, 8)
            );
        }
        other => panic!("wrong error {other:?}"),
    }
    assert!(e.to_string().contains("spans 9"), "{e}");
}

#[test]
fn overflowing_sizes() {
    let big = usize::MAX / 2;
    let e = ConvParams::conv2d(big, big, [3, 3])
        .weights_len()
        .err()
        .unwrap();
    assert_eq!(e, Error::Overflow { what: "weights" });
    let e = new(ConvParams::conv2d(1, 1, [1, 1]))
        .unwrap()
        .plan(big, big, 2)
        .err()
        .unwrap();
    assert!(matches!(e, Error::Overflow { .. }), "{e:?}");
    // Validation comes before the weights are looked at, so no weights are needed here.
    let huge_dilated = ConvParams::conv2d(1, 1, [1, usize::MAX / 2]).with_dilation([1, 4]);
    let e = Conv2d::new(huge_dilated, &[], None, Options::default())
        .err()
        .unwrap();
    assert!(matches!(e, Error::Overflow { .. }), "{e:?}");
}

#[test]
fn weights_and_bias_of_wrong_length() {
    let e = Conv2d::new(p(), &[0.0; 10], None, Options::default())
        .err()
        .unwrap();
    assert_eq!(
        e,
        Error::WrongLength {
            what: "weights",
            expected: 8 * 4 * 9,
            got: 10
        }
    );
    assert!(e.to_string().contains("288"), "{e}");
    let e = Conv2d::new(p(), &[0.0; 288], Some(&[0.0; 7]), Options::default())
        .err()
        .unwrap();
    assert_eq!(
        e,
        Error::WrongLength {
            what: "bias",
            expected: 8,
            got: 7
        }
    );
}

#[test]
fn slices_of_wrong_length_at_run() {
    let plan = new(p()).unwrap().plan(1, 5, 5).unwrap();
    let mut ws = Workspace::new();
    let (input, mut output) = (vec![0.0; plan.input_len()], vec![0.0; plan.output_len()]);
    let e = plan.run(&input[1..], &mut output, &mut ws).err().unwrap();
    assert_eq!(
        e,
        Error::WrongLength {
            what: "input",
            expected: 100,
            got: 99
        }
    );
    let e = plan.run(&input, &mut [0.0; 3], &mut ws).err().unwrap();
    assert_eq!(
        e,
        Error::WrongLength {
            what: "output",
            expected: 72,
            got: 3
        }
    );
    let e = plan
        .run_with_residual(&input, &[0.0; 5], &mut output, &mut ws)
        .err()
        .unwrap();
    assert_eq!(
        e,
        Error::WrongLength {
            what: "residual",
            expected: 72,
            got: 5
        }
    );
}

#[test]
fn invalid_activation_parameters() {
    let e = new(p().with_activation(Activation::Clamp { min: 1.0, max: 0.0 }))
        .err()
        .unwrap();
    assert!(
        matches!(
            e,
            Error::InvalidParameter {
                what: "clamp bounds",
                ..
            }
        ),
        "{e:?}"
    );
    let e = new(p().with_activation(Activation::Clamp {
        min: f32::NAN,
        max: 0.0,
    }))
    .err()
    .unwrap();
    assert!(matches!(e, Error::InvalidParameter { .. }), "{e:?}");
    let e = new(p().with_activation(Activation::LeakyRelu {
        alpha: f32::INFINITY,
    }))
    .err()
    .unwrap();
    assert!(
        matches!(
            e,
            Error::InvalidParameter {
                what: "leaky ReLU alpha",
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn conv1d_rejects_2d_params() {
    let e = Conv1d::new(p(), &[0.0; 288], None, Options::default())
        .err()
        .unwrap();
    assert!(
        matches!(
            e,
            Error::InvalidParameter {
                what: "1-D convolution",
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn unavailable_isa_is_an_error() {
    let missing = Isa::ALL
        .into_iter()
        .find(|i| !Isa::available().contains(i))
        .expect("no CPU has both AVX-512 and NEON");
    let opts = Options {
        isa: Some(missing),
        ..Options::default()
    };
    let e = Conv2d::new(p(), &[0.0; 288], None, opts).err().unwrap();
    assert!(matches!(e, Error::IsaUnavailable { .. }), "{e:?}");
    assert!(e.to_string().contains(missing.name()), "{e}");
    assert!("sse9".parse::<Isa>().is_err());
}

#[test]
fn workspace_too_large_is_out_of_memory() {
    let e = Workspace::with_bytes(1 << 62).err().unwrap();
    assert!(
        matches!(
            e,
            Error::OutOfMemory {
                what: "workspace",
                ..
            }
        ),
        "{e:?}"
    );
    let e = Workspace::new().reserve(usize::MAX).err().unwrap();
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e:?}");
    // A workspace that failed to grow is still usable.
    let mut ws = Workspace::new();
    assert!(ws.reserve(1 << 62).is_err());
    ws.reserve(1024).unwrap();
    assert!(ws.bytes() >= 1024);
}

#[test]
fn convolutions_and_plans_are_shared_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Conv2d>();
    send_sync::<Conv1d>();
    send_sync::<convkit::Plan>();
    send_sync::<Workspace>();
}
