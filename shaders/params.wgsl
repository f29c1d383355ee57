// The uniform every op shader takes at binding 0 (device/launch.py's ABI: 4-byte fields packed in this order,
// filled by name, the rest zero), appended to the shaders that name this file in an `// @include params` line.
// s0..s7: sizes and flags; o1..o12: the element offsets of bindings 1..12 (launch fills them); f0..f3: scalars.
// Each shader's header says what its s and f fields mean.

struct Params {
    s0: u32, s1: u32, s2: u32, s3: u32, s4: u32, s5: u32, s6: u32, s7: u32,
    o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32, o8: u32,
    o9: u32, o10: u32, o11: u32, o12: u32,
    f0: f32, f1: f32, f2: f32, f3: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
