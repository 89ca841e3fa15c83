//! MIG through the real nvml-wrapper: pre-existing devices, the layout rules from
//! test-peers.md §1.6, mode changes, and persistence across re-init.

mod common;

use std::collections::BTreeSet;
use std::ffi::c_uint;

use common::*;
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings::{nvmlComputeInstancePlacement_t, nvmlDeviceAttributes_t, nvmlGpuInstance_t};

const A100_MIG: &str = r#"
driver_version = "550.54.15"
cuda_driver_version = 12040
[[gpu]]
model = "A100-SXM4-40GB"
mig_mode = true
"#;

fn mig_ids(nvml: &Nvml, d: &nvml_wrapper::Device<'_>) -> (u32, u32) {
    let (mut gi, mut ci): (c_uint, c_uint) = (0, 0);
    unsafe {
        assert_eq!(sym!(nvml, nvmlDeviceGetGpuInstanceId)(handle(d), &mut gi), SUCCESS);
        assert_eq!(sym!(nvml, nvmlDeviceGetComputeInstanceId)(handle(d), &mut ci), SUCCESS);
    }
    (gi, ci)
}

#[test]
fn h100_preexisting_mig_devices() {
    let fake = Fake::new(&example("h100-mig.toml"));
    let nvml = fake.init();
    let gpu0 = nvml.device_by_index(0).unwrap();
    let gpu1 = nvml.device_by_index(1).unwrap();
    assert_eq!(gpu0.name().unwrap(), "NVIDIA H100 80GB HBM3");
    assert_eq!(gpu0.memory_info().unwrap().total, 81559 * 1024 * 1024);
    let mode = gpu0.mig_mode().unwrap();
    assert_eq!((mode.current, mode.pending), (1, 1));
    assert_eq!(gpu0.mig_device_count().unwrap(), 7);

    // GPU 0: 2g@0 (GI 3), 2g@2 (GI 4), 3g@4 (GI 2) in sparse slots 0, 2, 4.
    let mut seen = Vec::new();
    for slot in 0..7 {
        match gpu0.mig_device_by_index(slot) {
            Ok(m) => {
                assert!(m.mig_is_mig_device_handle().unwrap());
                let uuid = m.uuid().unwrap();
                assert!(uuid.starts_with("MIG-") && uuid.len() == 40, "{uuid}");
                assert_eq!(m.mig_parent_device().unwrap().uuid().unwrap(), gpu0.uuid().unwrap());
                assert_eq!(
                    nvml.device_by_uuid(uuid.as_str()).unwrap().name().unwrap(),
                    m.name().unwrap()
                );
                seen.push((
                    slot,
                    mig_ids(&nvml, &m),
                    m.name().unwrap(),
                    m.memory_info().unwrap().total >> 20,
                ));
            }
            Err(e) => assert!(matches!(e, NvmlError::NotFound), "slot {slot}: {e:?}"),
        }
    }
    assert_eq!(
        seen,
        vec![
            (0, (3, 0), "NVIDIA H100 80GB HBM3 MIG 2g.20gb".to_string(), 20096),
            (2, (4, 0), "NVIDIA H100 80GB HBM3 MIG 2g.20gb".to_string(), 20096),
            (4, (2, 0), "NVIDIA H100 80GB HBM3 MIG 3g.40gb".to_string(), 40448),
        ]
    );
    assert!(matches!(gpu0.mig_device_by_index(7), Err(NvmlError::InvalidArg)));
    // physical-only calls refuse MIG handles
    let m4 = gpu0.mig_device_by_index(4).unwrap();
    assert!(matches!(m4.mig_mode(), Err(NvmlError::InvalidArg)));
    assert!(matches!(gpu0.mig_parent_device(), Err(NvmlError::InvalidArg)));
    let mut attrs: nvmlDeviceAttributes_t = unsafe { std::mem::zeroed() };
    assert_eq!(
        unsafe { sym!(nvml, nvmlDeviceGetAttributes_v2)(handle(&m4), &mut attrs) },
        SUCCESS
    );
    assert_eq!(
        (
            attrs.multiprocessorCount,
            attrs.gpuInstanceSliceCount,
            attrs.computeInstanceSliceCount,
            attrs.memorySizeMB
        ),
        (60, 3, 3, 40448)
    );
    assert_eq!(
        (
            attrs.sharedCopyEngineCount,
            attrs.sharedDecoderCount,
            attrs.sharedJpegCount
        ),
        (3, 3, 3)
    );

    // GPU 1: 7x 1g.10gb, GI ids 7..13 by placement.
    let ids: Vec<(u32, u32)> = (0..7)
        .map(|s| mig_ids(&nvml, &gpu1.mig_device_by_index(s).unwrap()))
        .collect();
    assert_eq!(ids, (7..14).map(|g| (g, 0)).collect::<Vec<_>>());
    let uuids: BTreeSet<String> = (0..7)
        .map(|s| gpu1.mig_device_by_index(s).unwrap().uuid().unwrap())
        .collect();
    assert_eq!(uuids.len(), 7);

    // Profile tables through the raw V calls.
    let names: Vec<(u32, u32, String, u64)> = [0u32, 7, 9, 1, 2, 3, 4]
        .iter()
        .map(|&i| {
            let (rc, p) = gi_profile_v(&nvml, &gpu0, i);
            assert_eq!(rc, SUCCESS);
            (i, p.id, c_string(&p.name), p.memorySizeMB)
        })
        .collect();
    assert_eq!(
        names,
        vec![
            (0, 19, "MIG 1g.10gb".into(), 9984),
            (7, 20, "MIG 1g.10gb+me".into(), 9984),
            (9, 15, "MIG 1g.20gb".into(), 20096),
            (1, 14, "MIG 2g.20gb".into(), 20096),
            (2, 9, "MIG 3g.40gb".into(), 40448),
            (3, 5, "MIG 4g.40gb".into(), 40448),
            (4, 0, "MIG 7g.80gb".into(), 81152),
        ]
    );
    let (_, p15) = gi_profile_v(&nvml, &gpu0, 9);
    assert_eq!(
        (
            p15.multiprocessorCount,
            p15.instanceCount,
            p15.sliceCount,
            p15.jpegCount
        ),
        (26, 4, 1, 1)
    );
    assert_eq!(gi_profile_v(&nvml, &gpu0, 5).0, NOT_SUPPORTED);
    assert_eq!(gi_profile_v(&nvml, &gpu0, 18).0, INVALID_ARGUMENT);
    let (_, mut bad) = gi_profile_v(&nvml, &gpu0, 0);
    bad.version = 7;
    assert_eq!(
        unsafe { sym!(nvml, nvmlDeviceGetGpuInstanceProfileInfoV)(handle(&gpu0), 0, &mut bad) },
        INVALID_ARGUMENT
    );
    // placements: raw call works; nvml-wrapper 0.13's method returns an empty Vec (its bug).
    assert_eq!(
        placements(&nvml, &gpu0, 15),
        (SUCCESS, vec![(0, 2), (2, 2), (4, 2), (6, 2)])
    );
    assert_eq!(placements(&nvml, &gpu0, 0), (SUCCESS, vec![(0, 8)]));
    assert_eq!(placements(&nvml, &gpu0, 77).0, INVALID_ARGUMENT);
    assert!(gpu0.possible_placements(0).unwrap().is_empty());

    // GI listing and lookup, CI listing and profile names.
    let (rc, two_g) = gpu_instances(&nvml, &gpu0, 14);
    assert_eq!(rc, SUCCESS);
    let ids: Vec<u32> = two_g.iter().map(|&gi| gi_info(&nvml, gi).id).collect();
    assert_eq!(ids, vec![3, 4]);
    let mut three: nvmlGpuInstance_t = std::ptr::null_mut();
    assert_eq!(
        unsafe { sym!(nvml, nvmlDeviceGetGpuInstanceById)(handle(&gpu0), 2, &mut three) },
        SUCCESS
    );
    let info = gi_info(&nvml, three);
    assert_eq!((info.profileId, info.placement.start, info.placement.size), (9, 4, 4));
    assert_eq!(info.device, handle(&gpu0));
    assert_eq!(
        unsafe { sym!(nvml, nvmlDeviceGetGpuInstanceById)(handle(&gpu0), 1, &mut three) },
        NOT_FOUND
    );
    assert_eq!(
        unsafe { sym!(nvml, nvmlDeviceGetGpuInstanceById)(handle(&gpu0), 2, &mut three) },
        SUCCESS
    );
    let mut cis = vec![std::ptr::null_mut(); 3];
    let mut n: c_uint = 0;
    assert_eq!(
        unsafe { sym!(nvml, nvmlGpuInstanceGetComputeInstances)(three, 2, cis.as_mut_ptr(), &mut n) },
        SUCCESS
    );
    assert_eq!(n, 1);
    let ci = ci_info(&nvml, cis[0]);
    assert_eq!(
        (ci.id, ci.profileId, ci.placement.start, ci.placement.size),
        (0, 2, 0, 3)
    );
    assert_eq!(ci.gpuInstance, three);
    let ci_names: Vec<(u32, String, u32)> = [0u32, 1, 2]
        .iter()
        .map(|&i| {
            let (rc, p) = ci_profile_v(&nvml, three, i);
            assert_eq!(rc, SUCCESS);
            (p.id, c_string(&p.name), p.instanceCount)
        })
        .collect();
    assert_eq!(
        ci_names,
        vec![
            (0, "MIG 1c.3g.40gb".into(), 3),
            (1, "MIG 2c.3g.40gb".into(), 1),
            (2, "MIG 3g.40gb".into(), 1)
        ]
    );
    assert_eq!(ci_profile_v(&nvml, three, 3).0, NOT_SUPPORTED);
    // Full: nothing else fits on GPU 0.
    let mut cap: c_uint = 9;
    assert_eq!(
        unsafe { sym!(nvml, nvmlDeviceGetGpuInstanceRemainingCapacity)(handle(&gpu0), 19, &mut cap) },
        SUCCESS
    );
    assert_eq!(cap, 0);
}

#[test]
fn a100_layout_rules() {
    let fake = Fake::new(A100_MIG);
    let nvml = fake.init();
    let d = nvml.device_by_index(0).unwrap();

    // 7x 1g.5gb fits (first one at the highest placement), the 8th does not.
    let mut gis = Vec::new();
    for k in 0..7 {
        let (rc, gi) = create_gi(&nvml, &d, 19);
        assert_eq!(rc, SUCCESS, "1g #{k}");
        gis.push(gi);
    }
    assert_eq!(gi_info(&nvml, gis[0]).placement.start, 6);
    let ids: BTreeSet<u32> = gis.iter().map(|&g| gi_info(&nvml, g).id).collect();
    assert_eq!(ids, (7..14).collect());
    assert_eq!(create_gi(&nvml, &d, 19).0, INSUFFICIENT_RESOURCES);
    assert_eq!(gpu_instances(&nvml, &d, 19).1.len(), 7);
    for gi in &gis {
        assert_eq!(destroy_gi(&nvml, *gi), SUCCESS);
    }
    // a destroyed GI's handle is invalid
    assert_eq!(destroy_gi(&nvml, gis[0]), INVALID_ARGUMENT);

    // 4g then 3g fits: 0:4 and 4:4.
    let (rc, g4) = create_gi(&nvml, &d, 5);
    assert_eq!(rc, SUCCESS);
    let (rc, g3) = create_gi(&nvml, &d, 9);
    assert_eq!(rc, SUCCESS);
    let p = |gi| {
        let i = gi_info(&nvml, gi);
        (i.placement.start, i.placement.size)
    };
    assert_eq!((p(g4), p(g3)), ((0, 4), (4, 4)));
    assert_eq!(create_gi(&nvml, &d, 19).0, INSUFFICIENT_RESOURCES);
    assert_eq!(destroy_gi(&nvml, g4), SUCCESS);
    assert_eq!(destroy_gi(&nvml, g3), SUCCESS);

    // 2g@2 then 3g@0 overlaps; placements not in the list are INVALID_ARGUMENT.
    let (rc, g2) = create_gi_at(&nvml, &d, 14, 2, 2);
    assert_eq!(rc, SUCCESS);
    assert_eq!(gi_info(&nvml, g2).id, 4);
    assert_eq!(create_gi_at(&nvml, &d, 9, 0, 4).0, INSUFFICIENT_RESOURCES);
    assert_eq!(create_gi_at(&nvml, &d, 9, 2, 4).0, INVALID_ARGUMENT);
    assert_eq!(create_gi_at(&nvml, &d, 9, 4, 3).0, INVALID_ARGUMENT);
    assert_eq!(create_gi(&nvml, &d, 77).0, INVALID_ARGUMENT);

    // Destroying a GI with a compute instance is IN_USE.
    let (rc, ci) = create_ci(&nvml, g2, 1);
    assert_eq!(rc, SUCCESS);
    assert_eq!(destroy_gi(&nvml, g2), IN_USE);
    let slot2 = d.mig_device_by_index(2).unwrap();
    assert_eq!(slot2.name().unwrap(), "NVIDIA A100-SXM4-40GB MIG 2g.10gb");
    assert_eq!(destroy_ci(&nvml, ci), SUCCESS);
    assert_eq!(destroy_ci(&nvml, ci), INVALID_ARGUMENT);
    assert!(matches!(slot2.name(), Err(NvmlError::InvalidArg)));
    assert_eq!(destroy_gi(&nvml, g2), SUCCESS);

    // 1g.5gb+me exists once.
    let (rc, me) = create_gi(&nvml, &d, 20);
    assert_eq!(rc, SUCCESS);
    assert_eq!(create_gi(&nvml, &d, 20).0, INSUFFICIENT_RESOURCES);
    assert_eq!(destroy_gi(&nvml, me), SUCCESS);

    // Compute instances inside a 3g GI: three 1c, placements and capacity.
    let (_, g3) = create_gi_at(&nvml, &d, 9, 4, 4);
    let f = sym!(nvml, nvmlGpuInstanceGetComputeInstancePossiblePlacements);
    let mut count: c_uint = 0;
    assert_eq!(unsafe { f(g3, 0, std::ptr::null_mut(), &mut count) }, SUCCESS);
    assert_eq!(count, 3);
    let mut buf = vec![nvmlComputeInstancePlacement_t { start: 9, size: 9 }; 3];
    let mut small: c_uint = 2;
    assert_eq!(unsafe { f(g3, 0, buf.as_mut_ptr(), &mut small) }, INSUFFICIENT_SIZE);
    assert_eq!(unsafe { f(g3, 0, buf.as_mut_ptr(), &mut count) }, SUCCESS);
    assert_eq!(
        buf.iter().map(|p| (p.start, p.size)).collect::<Vec<_>>(),
        vec![(0, 1), (1, 1), (2, 1)]
    );
    let pl = nvmlComputeInstancePlacement_t { start: 1, size: 1 };
    let mut c1 = std::ptr::null_mut();
    let rc = unsafe { sym!(nvml, nvmlGpuInstanceCreateComputeInstanceWithPlacement)(g3, 0, &pl, &mut c1) };
    assert_eq!(rc, SUCCESS);
    assert_eq!(ci_info(&nvml, c1).id, 3);
    let mut left: c_uint = 0;
    let rem = sym!(nvml, nvmlGpuInstanceGetComputeInstanceRemainingCapacity);
    assert_eq!(unsafe { rem(g3, 0, &mut left) }, SUCCESS);
    assert_eq!(left, 2);
    assert_eq!(unsafe { rem(g3, 2, &mut left) }, SUCCESS);
    assert_eq!(left, 0);
    assert_eq!(create_ci(&nvml, g3, 2).0, INSUFFICIENT_RESOURCES);
    assert_eq!(create_ci(&nvml, g3, 0).0, SUCCESS);
    assert_eq!(create_ci(&nvml, g3, 0).0, SUCCESS);
    assert_eq!(create_ci(&nvml, g3, 0).0, INSUFFICIENT_RESOURCES);
    // MIG slots 4, 5, 6 with names 1c.3g.20gb
    let m5 = d.mig_device_by_index(5).unwrap();
    assert_eq!(m5.name().unwrap(), "NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb");
    assert_eq!(mig_ids(&nvml, &m5), (2, 3));
    assert_eq!(m5.memory_info().unwrap().total >> 20, 19968);
    assert!(matches!(d.mig_device_by_index(0), Err(NvmlError::NotFound)));
}

#[test]
fn mig_mode_changes_and_pending_state() {
    let fake = Fake::new(&A100_MIG.replace("mig_mode = true", "mig_mode = false"));
    let nvml = fake.init();
    let d = nvml.device_by_index(0).unwrap();
    let uuid = d.uuid().unwrap();

    // Busy GPU: SUCCESS with activation status IN_USE; only pending changes.
    fake_nvml::write_processes(&fake.state, &[(uuid.as_str(), 4242, 100)]).unwrap();
    assert_eq!(d.set_mig_mode(true).unwrap(), IN_USE);
    let m = d.mig_mode().unwrap();
    assert_eq!((m.current, m.pending), (0, 1));
    assert_eq!(create_gi(&nvml, &d, 19).0, NOT_SUPPORTED);
    assert_eq!(d.mig_device_count().unwrap(), 0);

    // Idle: the change applies.
    fake_nvml::write_processes(&fake.state, &[]).unwrap();
    assert_eq!(d.set_mig_mode(true).unwrap(), SUCCESS);
    let m = d.mig_mode().unwrap();
    assert_eq!((m.current, m.pending), (1, 1));
    assert_eq!(d.mig_device_count().unwrap(), 7);

    // Disabling with a GPU instance present: nothing changes, IN_USE.
    let (rc, gi) = create_gi(&nvml, &d, 0);
    assert_eq!(rc, SUCCESS);
    assert_eq!(gi_info(&nvml, gi).id, 0);
    assert_eq!(d.set_mig_mode(false).unwrap(), IN_USE);
    assert_eq!(d.mig_mode().unwrap().current, 1);
    assert_eq!(destroy_gi(&nvml, gi), SUCCESS);
    assert_eq!(d.set_mig_mode(false).unwrap(), SUCCESS);
    let m = d.mig_mode().unwrap();
    assert_eq!((m.current, m.pending), (0, 0));
    assert_eq!(gpu_instances(&nvml, &d, 19).0, NOT_SUPPORTED);
}

/// Every GPU instance profile (the V call, by index and by id) and its possible placements.
fn profile_answers(nvml: &Nvml, d: &nvml_wrapper::Device<'_>) -> Vec<(u32, u32, u32)> {
    (0..24)
        .map(|index| {
            let rc = gi_profile_v(nvml, d, index).0;
            let mut by_id: nvml_wrapper_sys::bindings::nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
            by_id.version = std::mem::size_of_val(&by_id) as u32 | (2 << 24);
            // 0..24 as profile ids too: some are the A100's ids, the rest unknown ones.
            let by_id_rc =
                unsafe { sym!(nvml, nvmlDeviceGetGpuInstanceProfileInfoByIdV)(handle(d), index, &mut by_id) };
            (rc, by_id_rc, placements(nvml, d, index).0)
        })
        .collect()
}

/// `profiles_need_mig` (drivers of the R535 class): while MIG mode is not current, no GPU
/// instance profile is listed, by index or id, and no placement; once it is, all are, as
/// without the key.
#[test]
fn profiles_need_mig_hides_the_profiles_while_mig_is_off() {
    let off = A100_MIG.replace("mig_mode = true", "mig_mode = false");
    let listed = {
        let plain = Fake::new(&off);
        let nvml = plain.init();
        let d = nvml.device_by_index(0).unwrap();
        assert_eq!(gi_profile_v(&nvml, &d, 0).0, SUCCESS, "listed with MIG off by default");
        assert_eq!(gi_profile_v(&nvml, &d, 18).0, INVALID_ARGUMENT);
        assert_eq!(placements(&nvml, &d, 19).1.len(), 7);
        profile_answers(&nvml, &d)
    };

    let fake = Fake::new(&format!("profiles_need_mig = true\n{off}"));
    let nvml = fake.init();
    let d = nvml.device_by_index(0).unwrap();
    let uuid = d.uuid().unwrap();
    for (index, answers) in profile_answers(&nvml, &d).into_iter().enumerate() {
        assert_eq!(
            answers,
            (NOT_SUPPORTED, NOT_SUPPORTED, NOT_SUPPORTED),
            "index/id {index} with MIG off"
        );
    }
    // A pending enable (processes run) is not enough: the mode must be current.
    fake_nvml::write_processes(&fake.state, &[(uuid.as_str(), 4242, 100)]).unwrap();
    assert_eq!(d.set_mig_mode(true).unwrap(), IN_USE);
    assert_eq!(gi_profile_v(&nvml, &d, 0).0, NOT_SUPPORTED);
    fake_nvml::write_processes(&fake.state, &[]).unwrap();
    assert_eq!(d.set_mig_mode(true).unwrap(), SUCCESS);
    assert_eq!(profile_answers(&nvml, &d), listed, "MIG on: as without the key");
    let (rc, info) = gi_profile_v(&nvml, &d, 0);
    assert_eq!((rc, info.id, info.sliceCount), (SUCCESS, 19, 1));
    assert_eq!(placements(&nvml, &d, 19).1.len(), 7);
    // Off again: hidden again.
    assert_eq!(d.set_mig_mode(false).unwrap(), SUCCESS);
    assert_eq!(gi_profile_v(&nvml, &d, 0).0, NOT_SUPPORTED);
    assert_eq!(placements(&nvml, &d, 19).0, NOT_SUPPORTED);
}

#[test]
fn state_survives_reinit() {
    let fake = Fake::new(A100_MIG);
    let (mig_uuid, gi_id) = {
        let nvml = fake.init();
        let d = nvml.device_by_index(0).unwrap();
        let (_, gi) = create_gi_at(&nvml, &d, 14, 2, 2);
        assert_eq!(create_ci(&nvml, gi, 0).0, SUCCESS);
        let m = d.mig_device_by_index(2).unwrap();
        (m.uuid().unwrap(), gi_info(&nvml, gi).id)
    };
    assert!(fake.state.join("state.json").is_file());

    // Same state dir: the layout is back.
    let nvml = fake.init();
    let d = nvml.device_by_index(0).unwrap();
    let m = d.mig_device_by_index(2).unwrap();
    assert_eq!(m.uuid().unwrap(), mig_uuid);
    assert_eq!(mig_ids(&nvml, &m), (gi_id, 1));
    assert_eq!(m.name().unwrap(), "NVIDIA A100-SXM4-40GB MIG 1c.2g.10gb");
    drop(nvml);

    // A new state dir starts from the machine file.
    let other = fake.dir.path().join("other-state");
    fake.set_env(Some(&fake.machine), Some(&other));
    let nvml = fake.init();
    let d = nvml.device_by_index(0).unwrap();
    assert!(matches!(d.mig_device_by_index(2), Err(NvmlError::NotFound)));
    drop(nvml);

    // A state file for other GPUs (different UUIDs) is ignored.
    let changed = A100_MIG.replace(
        "mig_mode = true",
        "mig_mode = true\nuuid = \"GPU-00000000-0000-0000-0000-000000000001\"",
    );
    std::fs::write(&fake.machine, changed).unwrap();
    fake.set_env(Some(&fake.machine), Some(&fake.state));
    let nvml = fake.init();
    let d = nvml.device_by_index(0).unwrap();
    assert!(matches!(d.mig_device_by_index(2), Err(NvmlError::NotFound)));
}

/// A30: 4 memory and 4 compute slices, 4 MIG device slots, GI ids on the 4-slice tree, the
/// `2_SLICE_REV1` (index 8) profile 2g.12gb+me, and nothing left once the slices are used.
#[test]
fn a30_four_slice_geometry() {
    let fake = Fake::new(&example("a30-mig.toml"));
    let nvml = fake.init();
    let gpu = nvml.device_by_index(0).unwrap();
    assert_eq!(gpu.name().unwrap(), "NVIDIA A30");
    assert_eq!(gpu.mig_device_count().unwrap(), 4);
    let seen: Vec<(u32, (u32, u32), String)> = (0..4)
        .filter_map(|slot| gpu.mig_device_by_index(slot).ok().map(|m| (slot, m)))
        .map(|(slot, m)| (slot, mig_ids(&nvml, &m), m.name().unwrap()))
        .collect();
    assert_eq!(
        seen,
        vec![
            (0, (1, 0), "NVIDIA A30 MIG 2g.12gb".to_string()),
            (2, (5, 0), "NVIDIA A30 MIG 1g.6gb".to_string()),
            (3, (6, 0), "NVIDIA A30 MIG 1g.6gb".to_string()),
        ]
    );
    assert!(matches!(gpu.mig_device_by_index(4), Err(NvmlError::InvalidArg)));

    let (rc, me) = gi_profile_v(&nvml, &gpu, 8);
    assert_eq!(rc, SUCCESS);
    assert_eq!(
        (me.id, me.sliceCount, c_string(&me.name)),
        (6, 2, "MIG 2g.12gb+me".into())
    );
    // 7_SLICE (index 4) does not exist on A30.
    assert_eq!(gi_profile_v(&nvml, &gpu, 4).0, NOT_SUPPORTED);
    assert_eq!(placements(&nvml, &gpu, 6), (SUCCESS, vec![(0, 2), (2, 2)]));
    assert_eq!(create_gi(&nvml, &gpu, 14).0, INSUFFICIENT_RESOURCES);
}

/// The Hopper and Blackwell models added from the MIG user guide's tables.
const GUIDE_MODELS: [&str; 5] = ["H200-141GB", "GH200-144GB", "H100-96GB", "B200", "RTX-PRO-6000"];

fn machine_of(models: &[&str]) -> String {
    let mut m = String::from("driver_version = \"580.95.05\"\ncuda_driver_version = 13000\n");
    for model in models {
        m.push_str(&format!("[[gpu]]\nmodel = \"{model}\"\nmig_mode = true\n"));
    }
    m
}

/// GPU-instance profiles NVML lists by probing indices 0.. until INVALID_ARGUMENT, as the
/// agent does: (index, id, name, instance count, slices, MiB).
fn listed_profiles(nvml: &Nvml, d: &nvml_wrapper::Device<'_>) -> Vec<(u32, u32, String, u32, u32, u64)> {
    let mut out = Vec::new();
    for index in 0.. {
        let (rc, p) = gi_profile_v(nvml, d, index);
        match rc {
            SUCCESS => out.push((
                index,
                p.id,
                c_string(&p.name),
                p.instanceCount,
                p.sliceCount,
                p.memorySizeMB,
            )),
            NOT_SUPPORTED => {}
            INVALID_ARGUMENT => break,
            other => panic!("index {index}: {other}"),
        }
        assert!(index < 64, "no INVALID_ARGUMENT");
    }
    out
}

/// Every new model through the real nvml-wrapper: NVML lists exactly the model's profiles
/// (NOT_SUPPORTED for indices it lacks, INVALID_ARGUMENT at 18), and on an empty GPU each
/// profile can be created as many times as its instance count says, no more, each instance
/// shows up as a MIG device named and sized after its profile, and all are destroyed again.
#[test]
fn guide_models_create_every_profile_to_its_instance_count() {
    let fake = Fake::new(&machine_of(&GUIDE_MODELS));
    let nvml = fake.init();
    for (g, key) in GUIDE_MODELS.iter().enumerate() {
        let model = fake_nvml::models::model_by_key(key).unwrap();
        let d = nvml.device_by_index(g as u32).unwrap();
        assert_eq!(d.name().unwrap(), model.name, "{key}");
        assert_eq!(d.mig_device_count().unwrap(), model.mig.max_mig_devices, "{key}");

        let listed = listed_profiles(&nvml, &d);
        let mut want: Vec<(u32, u32, String, u32, u32, u64)> = model
            .gi_profiles
            .iter()
            .map(|p| {
                (
                    p.index,
                    p.id,
                    format!("MIG {}", p.name),
                    p.instance_count,
                    p.slices,
                    p.memory_mib,
                )
            })
            .collect();
        want.sort();
        assert_eq!(listed, want, "{key}");
        assert_eq!(gi_profile_v(&nvml, &d, 17).0, NOT_SUPPORTED, "{key}");
        assert_eq!(gi_profile_v(&nvml, &d, 18).0, INVALID_ARGUMENT, "{key}");

        for p in model.gi_profiles {
            let what = format!("{key} {}", p.name);
            assert_eq!(
                placements(&nvml, &d, p.id),
                (SUCCESS, p.starts.iter().map(|&s| (s, p.mem_size)).collect()),
                "{what}"
            );
            let mut gis = Vec::new();
            for k in 0..p.instance_count {
                let (rc, gi) = create_gi(&nvml, &d, p.id);
                assert_eq!(rc, SUCCESS, "{what} #{k}");
                gis.push(gi);
            }
            assert_eq!(create_gi(&nvml, &d, p.id).0, INSUFFICIENT_RESOURCES, "{what}: one more");
            assert_eq!(gpu_instances(&nvml, &d, p.id).1.len(), gis.len(), "{what}");
            // One full-size compute instance in each: a MIG device named after the profile.
            let mut cis = Vec::new();
            for &gi in &gis {
                let full = (0..8)
                    .map(|i| ci_profile_v(&nvml, gi, i))
                    .find(|(rc, c)| *rc == SUCCESS && c.sliceCount == p.slices)
                    .map(|(_, c)| c)
                    .unwrap_or_else(|| panic!("{what}: no full-size CI profile"));
                assert_eq!(c_string(&full.name), format!("MIG {}", p.name), "{what}");
                let (rc, ci) = create_ci(&nvml, gi, full.id);
                assert_eq!(rc, SUCCESS, "{what}");
                cis.push(ci);
            }
            let devices: Vec<(String, u64)> = (0..model.mig.max_mig_devices)
                .filter_map(|slot| d.mig_device_by_index(slot).ok())
                .map(|m| (m.name().unwrap(), m.memory_info().unwrap().total >> 20))
                .collect();
            let name = format!("{} MIG {}", model.name, p.name);
            assert_eq!(devices, vec![(name, p.memory_mib); gis.len()], "{what}");
            for ci in cis {
                assert_eq!(destroy_ci(&nvml, ci), SUCCESS, "{what}");
            }
            for gi in gis {
                assert_eq!(destroy_gi(&nvml, gi), SUCCESS, "{what}");
            }
            assert_eq!(gpu_instances(&nvml, &d, p.id).1.len(), 0, "{what}");
        }
    }
}

/// RTX PRO 6000: the `+gfx`, `-me` and `+me.all` profiles are listed at NVML indices 10..16,
/// `+gfx` ones carry the GFX capability (profile info v3, and their compute instances'),
/// all of them can be created, machine files can name them (also as `1c.` compute
/// instances), and a mixed layout fills the 4 slices.
#[test]
fn rtx_pro_6000_gfx_and_media_engine_profiles() {
    use nvml_wrapper_sys::bindings::{nvmlComputeInstanceProfileInfo_v3_t, nvmlGpuInstanceProfileInfo_v3_t};
    let machine = format!(
        "{}[[gpu.mig_device]]\nprofile = \"1c.2g.48gb+gfx\"\nplacement = 0\n\
         [[gpu.mig_device]]\nprofile = \"1c.2g.48gb+gfx\"\nplacement = 0\n\
         [[gpu.mig_device]]\nprofile = \"1g.24gb+me.all\"\nplacement = 2\n\
         [[gpu.mig_device]]\nprofile = \"1g.24gb-me\"\nplacement = 3\n",
        machine_of(&["RTX-PRO-6000"])
    );
    let fake = Fake::new(&machine);
    let nvml = fake.init();
    let d = nvml.device_by_index(0).unwrap();
    assert_eq!(d.name().unwrap(), "NVIDIA RTX PRO 6000 Blackwell Server Edition");

    // The machine file's devices: 2g.48gb+gfx@0 split into two 1c, 1g+me.all@2, 1g-me@3.
    let seen: Vec<(u32, String)> = (0..4)
        .filter_map(|slot| d.mig_device_by_index(slot).ok().map(|m| (slot, m.name().unwrap())))
        .collect();
    let n = |p: &str| format!("NVIDIA RTX PRO 6000 Blackwell Server Edition MIG {p}");
    assert_eq!(
        seen,
        vec![
            (0, n("1c.2g.48gb+gfx")),
            (1, n("1c.2g.48gb+gfx")),
            (2, n("1g.24gb+me.all")),
            (3, n("1g.24gb-me")),
        ]
    );
    assert_eq!(create_gi(&nvml, &d, 14).0, INSUFFICIENT_RESOURCES);

    let kinds: Vec<(u32, u32, String)> = (10..17)
        .map(|i| {
            let (rc, p) = gi_profile_v(&nvml, &d, i);
            assert_eq!(rc, SUCCESS, "index {i}");
            (i, p.id, c_string(&p.name))
        })
        .collect();
    assert_eq!(
        kinds,
        vec![
            (10, 47, "MIG 1g.24gb+gfx".into()),
            (11, 35, "MIG 2g.48gb+gfx".into()),
            (12, 32, "MIG 4g.96gb+gfx".into()),
            (13, 67, "MIG 1g.24gb-me".into()),
            (14, 66, "MIG 2g.48gb-me".into()),
            (15, 65, "MIG 1g.24gb+me.all".into()),
            (16, 64, "MIG 2g.48gb+me.all".into()),
        ]
    );
    // 7_SLICE and the other 8-slice indices do not exist here.
    for i in [2, 4, 5, 6, 8, 9] {
        assert_eq!(gi_profile_v(&nvml, &d, i).0, NOT_SUPPORTED, "index {i}");
    }

    // Capabilities through profile info v3: GFX on +gfx profiles only.
    let caps = |index: u32| {
        let mut info: nvmlGpuInstanceProfileInfo_v3_t = unsafe { std::mem::zeroed() };
        info.version = std::mem::size_of::<nvmlGpuInstanceProfileInfo_v3_t>() as u32 | (3 << 24);
        let f = sym!(nvml, nvmlDeviceGetGpuInstanceProfileInfoV);
        let rc = unsafe {
            f(
                handle(&d),
                index,
                (&mut info as *mut nvmlGpuInstanceProfileInfo_v3_t).cast(),
            )
        };
        assert_eq!(rc, SUCCESS);
        info.capabilities
    };
    let gfx: Vec<u32> = (10..17).map(caps).collect();
    assert_eq!(gfx, vec![2, 2, 2, 0, 0, 0, 0]);
    assert_eq!((caps(0), caps(3)), (0, 0));

    // Empty the GPU (compute instances first), then create each kind.
    for p in fake_nvml::models::model_by_key("RTX-PRO-6000").unwrap().gi_profiles {
        for gi in gpu_instances(&nvml, &d, p.id).1 {
            let mut cis = vec![std::ptr::null_mut(); 4];
            for ci_index in 0..4 {
                let mut n: c_uint = 0;
                let f = sym!(nvml, nvmlGpuInstanceGetComputeInstances);
                if unsafe { f(gi, ci_index, cis.as_mut_ptr(), &mut n) } == SUCCESS {
                    for &ci in &cis[..n as usize] {
                        assert_eq!(destroy_ci(&nvml, ci), SUCCESS);
                    }
                }
            }
            assert_eq!(destroy_gi(&nvml, gi), SUCCESS, "{}", p.name);
        }
    }
    assert!(matches!(d.mig_device_by_index(0), Err(NvmlError::NotFound)));
    for (index, id) in [(10, 47), (11, 35), (12, 32), (13, 67), (14, 66), (15, 65), (16, 64)] {
        let (rc, gi) = create_gi(&nvml, &d, id);
        assert_eq!(rc, SUCCESS, "index {index}");
        assert_eq!(gi_info(&nvml, gi).profileId, id);
        // Compute instances of a +gfx GI carry the CI GFX capability.
        let mut ci: nvmlComputeInstanceProfileInfo_v3_t = unsafe { std::mem::zeroed() };
        ci.version = std::mem::size_of::<nvmlComputeInstanceProfileInfo_v3_t>() as u32 | (3 << 24);
        let f = sym!(nvml, nvmlGpuInstanceGetComputeInstanceProfileInfoV);
        assert_eq!(
            unsafe { f(gi, 0, 0, (&mut ci as *mut nvmlComputeInstanceProfileInfo_v3_t).cast()) },
            SUCCESS
        );
        assert_eq!(ci.capabilities, u32::from(index <= 12), "index {index}");
        let (rc, c) = create_ci(&nvml, gi, 0);
        assert_eq!(rc, SUCCESS, "index {index}");
        assert_eq!(destroy_ci(&nvml, c), SUCCESS);
        assert_eq!(destroy_gi(&nvml, gi), SUCCESS);
    }
    // A mixed layout: 2g.48gb-me + 1g.24gb+gfx + 1g.24gb+me fills the GPU.
    let (rc, _) = create_gi_at(&nvml, &d, 66, 0, 2);
    assert_eq!(rc, SUCCESS);
    assert_eq!(create_gi_at(&nvml, &d, 47, 2, 1).0, SUCCESS);
    assert_eq!(create_gi_at(&nvml, &d, 21, 3, 1).0, SUCCESS);
    assert_eq!(create_gi(&nvml, &d, 67).0, INSUFFICIENT_RESOURCES);
}
