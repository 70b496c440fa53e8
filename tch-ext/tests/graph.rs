//! `reachable_leaves`: which leaves a backward pass from a root would reach, on CPU.

use tch::{Kind, Tensor};
use tch_ext::{reachable_leaves, set_backward, TchExtError};

fn leaf(values: &[f32]) -> Tensor {
    Tensor::from_slice(values).set_requires_grad(true)
}

/// Three leaves, the loss uses two: through a product, and through a view.
#[test]
fn the_leaves_a_loss_uses_are_reached_and_the_others_not() {
    let (a, b, c) = (leaf(&[1.0, 2.0]), leaf(&[3.0, 4.0, 5.0]), leaf(&[6.0]));
    let loss = (&a * 2.0).sum(Kind::Float) + b.narrow(0, 1, 2).sum(Kind::Float);
    assert_eq!(
        reachable_leaves(&loss, &[&a, &b, &c]).unwrap(),
        [true, true, false]
    );
    assert_eq!(reachable_leaves(&loss, &[]).unwrap(), Vec::<bool>::new());
}

/// A leaf another live graph uses has an accumulator, but not one this root reaches.
#[test]
fn a_leaf_used_only_by_another_graph_is_not_reached() {
    let (a, b) = (leaf(&[1.0]), leaf(&[2.0]));
    let other = (&b * 3.0).sum(Kind::Float);
    let loss = (&a * 2.0).sum(Kind::Float);
    assert_eq!(reachable_leaves(&loss, &[&a, &b]).unwrap(), [true, false]);
    assert_eq!(reachable_leaves(&other, &[&a, &b]).unwrap(), [false, true]);
    // Both graphs together: the sum reaches both.
    assert_eq!(
        reachable_leaves(&(&loss + &other), &[&a, &b]).unwrap(),
        [true, true]
    );
}

/// A root that is itself a leaf reaches only itself (its backward accumulates into it alone);
/// a root outside autograd reaches nothing.
#[test]
fn a_leaf_root_reaches_itself_and_a_constant_root_nothing() {
    let (a, b) = (leaf(&[1.0]), leaf(&[2.0]));
    assert_eq!(reachable_leaves(&a, &[&a, &b]).unwrap(), [true, false]);
    // Another handle to the same tensor is the same leaf.
    assert_eq!(
        reachable_leaves(&a.shallow_clone(), &[&b, &a]).unwrap(),
        [false, true]
    );
    let constant = Tensor::from_slice(&[1.0f32]);
    assert_eq!(
        reachable_leaves(&constant, &[&a, &b]).unwrap(),
        [false, false]
    );
    let detached = (&a * 2.0).detach();
    assert_eq!(reachable_leaves(&detached, &[&a]).unwrap(), [false]);
}

/// The walk passes through a backward function written in Rust, to its input's leaves.
#[test]
fn the_walk_passes_through_a_rust_backward_function() {
    let (a, b) = (leaf(&[1.0, 2.0]), leaf(&[3.0]));
    let input = &a * 2.0;
    let out = input.detach().copy();
    set_backward(&input, &out, |g| Ok(g.shallow_clone())).unwrap();
    let loss = out.sum(Kind::Float);
    assert_eq!(reachable_leaves(&loss, &[&a, &b]).unwrap(), [true, false]);
}

/// The walk is iterative: a graph far deeper than a thread's stack allows for recursion.
#[test]
fn a_deep_graph_is_walked_without_recursion() {
    let (a, b) = (leaf(&[1.0]), leaf(&[1.0]));
    let mut x = &b * 1.0;
    for _ in 0..100_000 {
        x = &x + 0.0;
    }
    let deep = &x * &a;
    assert_eq!(reachable_leaves(&deep, &[&a, &b]).unwrap(), [true, true]);
    let y = (&a * 1.0).sum(Kind::Float);
    assert_eq!(reachable_leaves(&y, &[&a, &b]).unwrap(), [true, false]);
}

#[test]
fn an_undefined_tensor_is_an_error() {
    let a = leaf(&[1.0]);
    let undefined = Tensor::new();
    let loss = (&a * 2.0).sum(Kind::Float);
    match reachable_leaves(&loss, &[&a, &undefined]) {
        Err(TchExtError::Torch(m)) => assert!(
            m.starts_with("reachable_leaves: leaf 1 of the graph walk is an undefined tensor"),
            "{m}"
        ),
        other => panic!("expected an error, got {other:?}"),
    }
    match reachable_leaves(&undefined, &[&a]) {
        Err(TchExtError::Torch(m)) => assert!(
            m.starts_with("reachable_leaves: the root of the graph walk is an undefined tensor"),
            "{m}"
        ),
        other => panic!("expected an error, got {other:?}"),
    }
}
