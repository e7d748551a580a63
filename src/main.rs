fn main() {
    println!("ipcreduce");
}
