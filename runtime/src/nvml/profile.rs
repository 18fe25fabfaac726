//! MIG profile names as `nvidia-smi` and the NVIDIA device plugin write them (`1g.10gb`,
//! `1c.2g.20gb`), from the slice counts and memory NVML reports for a MIG device.

/// The name of a MIG device's profile. The memory part is not the device's memory in GiB
/// (a `1g.10gb` slice of an 80 GB A100 has 9856 MiB): NVIDIA rounds the device's share of its
/// GPU's memory up to eighths, then scales the GPU's size in GB by it and rounds to the nearest.
pub fn name(gi_slices: u32, ci_slices: u32, memory_mib: u64, parent_bytes: u64) -> String {
    let gb = memory_gb(memory_mib, parent_bytes);
    if ci_slices != 0 && ci_slices < gi_slices {
        format!("{ci_slices}c.{gi_slices}g.{gb}gb")
    } else {
        format!("{gi_slices}g.{gb}gb")
    }
}

fn memory_gb(memory_mib: u64, parent_bytes: u64) -> u64 {
    let parent_mib = parent_bytes >> 20;
    if parent_mib == 0 {
        return memory_mib.div_ceil(1024);
    }
    let parent_gb = parent_mib.div_ceil(1024);
    // round(ceil(8 * share) / 8 * parent_gb), in integers, as NVIDIA's go-nvlib computes it.
    let eighths = (memory_mib * 8).div_ceil(parent_mib);
    (eighths * parent_gb + 4) / 8
}

#[cfg(test)]
mod tests {
    use super::*;

    const A100_80GB: u64 = 81920 << 20;
    const A100_40GB: u64 = 40960 << 20;

    #[test]
    fn a100_profiles_are_named_as_nvidia_smi_names_them() {
        assert_eq!(name(1, 1, 9856, A100_80GB), "1g.10gb");
        assert_eq!(name(2, 2, 19968, A100_80GB), "2g.20gb");
        assert_eq!(name(3, 3, 40192, A100_80GB), "3g.40gb");
        assert_eq!(name(7, 7, 80896, A100_80GB), "7g.80gb");
        assert_eq!(name(1, 1, 4864, A100_40GB), "1g.5gb");
        assert_eq!(name(7, 7, 40192, A100_40GB), "7g.40gb");
    }

    #[test]
    fn a_share_of_an_odd_sized_gpu_rounds_to_the_nearest_gb() {
        // An H200 (141 GB): a quarter is 35.25 GB, which NVIDIA names 35.
        const H200: u64 = 143_771 << 20;
        assert_eq!(name(2, 2, 33_280, H200), "2g.35gb");
        assert_eq!(name(1, 1, 16_896, H200), "1g.18gb");
    }

    #[test]
    fn a_smaller_compute_instance_is_named_first() {
        assert_eq!(name(2, 1, 19968, A100_80GB), "1c.2g.20gb");
    }
}
