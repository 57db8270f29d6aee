//! Output-shape arithmetic and ONNX auto_pad semantics, against values worked by hand.

use convkit::{ConvParams, Padding};

fn axis(padding: Padding, input: usize, k: usize, s: usize, d: usize) -> (usize, usize, usize) {
    let g = ConvParams::conv2d(1, 1, [1, k])
        .with_stride([1, s])
        .with_dilation([1, d])
        .with_padding(padding)
        .geometry(1, 1, input)
        .unwrap();
    (g.pad_left, g.pad_right, g.ow)
}

#[test]
fn same_upper_puts_the_odd_pixel_at_the_end() {
    assert_eq!(axis(Padding::Same, 5, 3, 2, 1), (1, 1, 3)); // total 2
    assert_eq!(axis(Padding::Same, 6, 3, 2, 1), (0, 1, 3)); // total 1
    assert_eq!(axis(Padding::Same, 10, 4, 1, 1), (1, 2, 10)); // total 3
    assert_eq!(axis(Padding::Same, 7, 3, 1, 2), (2, 2, 7)); // span 5, total 4
    assert_eq!(axis(Padding::Same, 7, 1, 3, 1), (0, 0, 3)); // no padding needed
}

#[test]
fn same_lower_puts_the_odd_pixel_at_the_beginning() {
    assert_eq!(axis(Padding::SameLower, 6, 3, 2, 1), (1, 0, 3));
    assert_eq!(axis(Padding::SameLower, 10, 4, 1, 1), (2, 1, 10));
}

#[test]
fn valid_and_explicit() {
    assert_eq!(axis(Padding::Valid, 6, 3, 2, 1), (0, 0, 2));
    assert_eq!(axis(Padding::Valid, 16000, 10, 5, 1), (0, 0, 3199)); // wav2vec2's first conv
    let explicit = Padding::Explicit {
        top: 0,
        bottom: 0,
        left: 3,
        right: 1,
    };
    assert_eq!(axis(explicit, 8, 7, 2, 1), (3, 1, 3)); // (8+4-7)/2+1
}
