//! Its own process: the driver answers NOT_INITIALIZED until cuInit, as CUDA does.
use tcpxd_cudastub::*;

#[test]
fn driver_calls_before_cu_init_are_refused() {
    let mut n = -1;
    assert_eq!(cuDeviceGetCount(&mut n), CUDA_ERROR_NOT_INITIALIZED);
    assert_eq!(n, -1, "nothing written");
    assert_eq!(cuInit(0), CUDA_SUCCESS);
    assert_eq!(cuDeviceGetCount(&mut n), CUDA_SUCCESS);
    assert_eq!(n as usize, device_count());
}

#[test]
fn a_thread_s_current_device_is_the_default_until_it_sets_one() {
    let mut dev = -1;
    assert_eq!(cudaGetDevice(&mut dev), CUDA_RT_SUCCESS);
    assert_eq!(dev, default_device());
    assert_eq!(cudaSetDevice(0), CUDA_RT_SUCCESS);
    assert_eq!(cudaGetDevice(&mut dev), CUDA_RT_SUCCESS);
    assert_eq!(dev, 0);
    assert_eq!(cudaSetDevice(99), CUDA_RT_ERROR_INVALID_DEVICE);
}
