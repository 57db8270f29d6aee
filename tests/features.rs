//! What the cargo features leave out is gone: no kernel of an ISA or family the build left
//! out is registered or chosen, and asking for a left-out ISA is `IsaUnavailable`. Runs in
//! every configuration (`.ci/run` runs it in the lean one too).

use convkit::{cpu, Conv2d, ConvParams, Error, Isa, Options, Workspace};

#[test]
fn isa_features_decide_what_is_built() {
    assert!(Isa::Scalar.built());
    assert_eq!(Isa::Avx2.built(), cfg!(feature = "avx2"));
    assert_eq!(Isa::Avx512.built(), cfg!(feature = "avx512"));
    assert_eq!(Isa::Neon.built(), cfg!(feature = "neon"));
    for &isa in Isa::available() {
        assert!(isa.built(), "{isa} is available but was not built");
    }
    for k in cpu::registry() {
        assert!(
            k.isa.built(),
            "{} is registered but {} was not built",
            k.name,
            k.isa
        );
    }
}

#[test]
fn a_left_out_isa_is_unavailable() {
    let params = ConvParams::conv2d(2, 2, [1, 1]);
    for isa in Isa::ALL.into_iter().filter(|i| !i.built()) {
        let options = Options {
            isa: Some(isa),
            ..Default::default()
        };
        let r = Conv2d::new(params, &[1.0; 4], None, options);
        assert!(matches!(r, Err(Error::IsaUnavailable { .. })), "{isa}");
    }
    // Every level that is available runs.
    for &isa in Isa::available() {
        let options = Options {
            isa: Some(isa),
            threads: 3, // without the threads feature: three shares, one after another
            ..Default::default()
        };
        let conv = Conv2d::new(params, &[1.0, 0.0, 0.0, 1.0], None, options).unwrap();
        let plan = conv.plan(1, 5, 7).unwrap();
        let x: Vec<f32> = (0..plan.input_len()).map(|i| i as f32).collect();
        let mut y = vec![0.0; plan.output_len()];
        plan.run(&x, &mut y, &mut Workspace::new()).unwrap();
        assert_eq!(x, y, "{isa}: an identity 1x1 convolution");
    }
}

#[test]
fn int8_feature_decides_the_int8_family() {
    let int8 = cpu::registry().iter().any(|k| k.family.is_int8());
    assert_eq!(int8, cfg!(feature = "int8"));
}
