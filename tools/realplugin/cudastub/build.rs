// The stand-in is installed as libcuda.so.1 (and libcudart.so.12 as a link to it): give it that soname
// so the plugin linked against it records libcuda.so.1.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
